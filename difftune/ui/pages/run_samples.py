"""The run page's samples: the gallery by step, the "sample with this LoRA" sets, and the
full-size viewer that steps through them.

A long run holds thousands of samples: the gallery shows the newest steps (more on request)
and adds what is new without redrawing the rest. A click on a thumbnail opens the viewer:
the image at its own size with its prompt, seed and step; arrows (buttons, or the keys
left/right and up/down) go to the same prompt at the previous/next step, and to the
previous/next prompt of the same step.
"""

from __future__ import annotations

from typing import Callable
from urllib.parse import urlencode

from nicegui import ui

from difftune.ui.lora_samples import SampleSet
from difftune.ui.pages.keyed import Keyed
from difftune.ui.run_outputs import SampleImage

STEPS_SHOWN = 8  # sample steps shown at first; "show older" adds as many again
Images = list[SampleImage]


def image_url(image: SampleImage) -> str:
    """Where the browser fetches a sample image: a clip's animated preview, which plays in
    the <img>, in place of its first frame."""
    return f"/api/runs/image?{urlencode({'path': image.preview or image.path})}"


def by_step(images: Images) -> list[tuple[int, tuple[SampleImage, ...]]]:
    """The images grouped by step, newest step first ("other" labels as step -1, last), each
    group by prompt index."""
    groups: dict[int, list[SampleImage]] = {}
    for image in images:
        groups.setdefault(image.step if image.step is not None else -1, []).append(image)
    return [(step, tuple(sorted(groups[step], key=lambda i: (i.label, i.index))))
            for step in sorted(groups, reverse=True, key=lambda s: (s >= 0, s))]


def thumb(image: SampleImage, on_click: Callable[[], object], testid: str = "sample") -> None:
    """One sample with its prompt under it; a click opens the viewer."""
    with ui.column().classes("w-40 gap-0"):
        ui.image(image_url(image)).classes("w-40 h-40 cursor-pointer") \
            .props(f'fit="contain" data-testid="{testid}"').on("click", on_click)
        ui.label(image.prompt).classes("text-xs")


class Viewer:
    """The full-size viewer: one dialog for the page, showing one image of a collection
    (`source()`: the collection as it is now)."""

    def __init__(self) -> None:
        self.source: Callable[[], Images] = list
        self.current: SampleImage | None = None
        with ui.dialog().props("maximized") as self.dialog, \
                ui.card().classes("w-full items-center").props('data-testid="viewer"'):
            with ui.row().classes("w-full items-center justify-between"):
                self.where = ui.label().classes("font-bold").props('data-testid="viewer-step"')
                ui.button(icon="close", on_click=self.dialog.close).props("flat round")
            self.image = ui.element("img").style(  # at its own size, unless that is larger
                "width: auto; height: auto; max-width: 95vw; max-height: 72vh; "
                "align-self: center; flex: none; image-rendering: pixelated") \
                .props('data-testid="viewer-image"')
            self.prompt = ui.label().classes("text-lg").props('data-testid="viewer-prompt"')
            self.seed = ui.label().classes("text-sm text-gray-600") \
                .props('data-testid="viewer-seed"')
            with ui.row().classes("gap-2"):
                self.buttons = {name: ui.button(text, on_click=lambda n=name: self.go(n))
                                .props(f'flat data-testid="viewer-{name}"')
                                for name, text in (("prev-step", "◀ step"),
                                                   ("next-step", "step ▶"),
                                                   ("prev-prompt", "▲ prompt"),
                                                   ("next-prompt", "prompt ▼"))}
        keys = {"ArrowLeft": "prev-step", "ArrowRight": "next-step",
                "ArrowUp": "prev-prompt", "ArrowDown": "next-prompt"}
        ui.keyboard(lambda e: self._key(keys.get(e.key.name), e.action.keydown),
                    ignore=["input", "select", "textarea"])

    def open(self, image: SampleImage, source: Callable[[], Images]) -> None:
        """Show `image`, navigating within `source()`."""
        self.source = source
        self.show(image)
        self.dialog.open()

    def show(self, image: SampleImage) -> None:
        """Put `image` in the dialog."""
        self.current = image
        self.image._props["src"] = image_url(image)
        self.image.update()
        self.prompt.text = image.prompt
        self.seed.text = f"seed {image.seed}" if image.seed is not None else \
            "seed unknown (the prompt file has changed since)"
        step = f"step {image.step}" if image.step is not None else image.label
        self.where.text = f"{step} · prompt {image.index + 1}"
        for name, button in self.buttons.items():
            button.enabled = self.neighbour(name) is not None

    def _key(self, name: str | None, down: bool) -> None:
        if name is not None and down and self.dialog.value:
            self.go(name)

    def go(self, name: str) -> None:
        """Move to the neighbour `name` names (nothing at either end)."""
        found = self.neighbour(name)
        if found is not None:
            self.show(found)

    def neighbour(self, name: str) -> SampleImage | None:
        """The image before/after the current one: the same prompt index at the previous or
        next step (label), or the previous/next prompt of the same step."""
        now = self.current
        if now is None:
            return None
        images = self.source()
        if name.endswith("step"):
            row = [i for i in images if i.index == now.index]
        else:
            row = [i for i in images if i.label == now.label]
        row.sort(key=lambda i: (i.step is None, i.step or 0, i.label, i.index))
        at = next((n for n, i in enumerate(row) if i.path == now.path), None)
        if at is None:
            return None
        other = at - 1 if name.startswith("prev") else at + 1
        return row[other] if 0 <= other < len(row) else None


class Gallery:
    """The run's samples by step, newest first: the newest `STEPS_SHOWN` steps at first."""

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self.images: Images = []
        self.limit = STEPS_SHOWN
        self.groups = Keyed(ui.column().classes("w-full gap-2").props('data-testid="gallery"'))
        self.more = ui.button(on_click=self._more).props('flat data-testid="gallery-more"')
        self.more.visible = False
        self._by_step: dict[int, tuple[SampleImage, ...]] = {}

    def update(self, images: Images) -> None:
        """Show `images` (the run's samples as they are now): only new or changed steps are
        drawn."""
        self.images = images
        grouped = by_step(images)
        self._by_step = dict(grouped)
        shown = grouped[:self.limit]
        self.groups.sync([(step, tuple(i.path for i in group)) for step, group in shown],
                         self._group)
        hidden = len(grouped) - len(shown)
        self.more.visible = hidden > 0
        self.more.text = f"show older samples ({hidden} more step(s))"

    def _more(self) -> None:
        self.limit += STEPS_SHOWN
        self.update(self.images)

    def _group(self, step: int) -> ui.element:
        """One step's label and thumbnails."""
        with ui.column().classes("gap-1") as group:
            ui.label(f"step {step}" if step >= 0 else "other").classes("font-bold")
            with ui.row().classes("gap-2").props(f'data-testid="samples-step-{step}"'):
                for image in self._by_step[step]:
                    thumb(image, lambda i=image: self.viewer.open(i, lambda: self.images))
        return group


class SampleSets:
    """The "sample with this LoRA" folders of the run, newest first, each with its images."""

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self.sets: dict[str, SampleSet] = {}
        self.title = ui.label("Samples with a LoRA").classes("text-xl")
        self.title.visible = False
        self.list = Keyed(ui.column().classes("w-full gap-2").props('data-testid="lora-sets"'))

    def update(self, sets: list[SampleSet]) -> None:
        """Show `sets` (only new or changed ones are drawn)."""
        self.sets = {s.folder: s for s in sets}
        self.title.visible = bool(sets)
        self.list.sync([(s.folder, (s.lora, s.strength, tuple(i.path for i in s.images)))
                        for s in sets], self._set)

    def _set(self, folder: str) -> ui.element:
        """One set: its folder, LoRA, strength and seeds, then its images."""
        found = self.sets[folder]
        name = folder.rstrip("/").rsplit("/", 1)[-1]
        lora = (found.lora or "?").rsplit("/", 1)[-1]
        with ui.column().classes("gap-1").props(f'data-testid="lora-set-{name}"') as box:
            ui.label(f"{name}: {lora} at strength {found.strength}, seeds "
                     f"{', '.join(map(str, found.seeds))}"
                     + (f" (job {found.job})" if found.job is not None else "")) \
                .classes("font-bold")
            if not found.images:
                ui.label("no images yet: the sample job writes them when it has run") \
                    .classes("text-sm text-gray-600")
            with ui.row().classes("gap-2"):
                for image in found.images:
                    thumb(image, lambda i=image: self.viewer.open(
                        i, lambda: self.sets[folder].images if folder in self.sets else []),
                        testid="lora-sample")
        return box
