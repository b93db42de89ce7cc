"""Presets per example and GPU memory (24, 16 and 12 GiB), made from the example configs.

Each example in `examples/` names the released model it is sized for and its GPU in its header
(`# Memory: black-forest-labs/FLUX.1-dev on a 24 GB GPU: estimated peak ...`); the model's
parameter counts come from its family's spec (`ModelSize`). Every preset is the example plus
the memory savers `difftune.memory.estimate.fit` says that card needs (the same estimate
`difftune check` prints and the README's table shows): gradient checkpointing, an int8
denoiser, int8 text encoders, 8-bit AdamW, then the fewest swapped blocks that fit. Where even
all of them do not fit, there is no preset (`refused` says why). A full fine-tune's example
gets its own GPU size only: its trained weights are not what these savers shrink.
Every preset writes its outputs next to the run file (`save.dir = "."`), where the app saves
it. The tiny FLUX.1 preset (`tiny-lora.toml`, CPU) points its dataset and prompts at the demo
images bundled with the package.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from difftune.config.sections import ModelConfig
from difftune.families.specs import FamilySpec, ModelSize
from difftune.memory import estimate
from difftune.ui.forms import toml_io

# The family a run file without `model.family` gets (the config model's default).
DEFAULT_FAMILY: str = ModelConfig.model_fields["family"].default

SIZES = estimate.CARDS
_HEADER = re.compile(r"^# Memory: (.+?) on an? (\d+) GB GPU(?:: estimated peak ([\d.]+) GiB)?",
                     re.MULTILINE)
TINY = "tiny-lora.toml"


@dataclass(frozen=True)
class Header:
    """What an example's header says: the released model it is sized for, its GPU (GB) and
    the estimated peak it quotes (None where it quotes none)."""

    model: str
    gpu: int
    quoted: float | None


@dataclass
class Preset:
    """One preset: its TOML text and how it was made."""

    name: str
    title: str
    family: str
    gib: int | None
    example: str
    savers: list[str] = field(default_factory=list)
    estimate_gib: float | None = None
    toml: str = ""

    def note(self) -> str:
        """What the preset adds to its example and its estimated peak, as the form shows it."""
        if self.gib is None:
            return "CPU demo: no GPU memory needed"
        if self.estimate_gib is None:
            return f"the example as written, made for {self.gib} GB (a full fine-tune)"
        adds = (f"adds {', '.join(self.savers)} to {self.example}" if self.savers
                else f"{self.example} as written")
        return (f"estimated peak {self.estimate_gib:.1f} GiB on the GPU ({estimate.LABEL}); "
                f"{adds}")


@dataclass
class Refusal:
    """An example and GPU size without a preset, and why."""

    example: str
    gib: int
    reason: str


def examples_dir() -> Path:
    """The example run files the presets are made from, as the package ships them
    (`difftune/assets/examples`, in a source checkout a link to the top-level `examples/`), so
    an installed wheel has them too."""
    return Path(str(resources.files("difftune") / "assets" / "examples"))


def demo_dir() -> Path:
    """The demo images bundled with the package."""
    return Path(__file__).resolve().parents[2] / "assets" / "demo"


def header(text: str) -> Header | None:
    """The model and GPU an example's header names, or None."""
    m = _HEADER.search(text)
    if m is None:
        return None
    return Header(m[1], int(m[2]), float(m[3]) if m[3] else None)


def sized(path: Path) -> tuple[dict[str, Any], FamilySpec, ModelSize, Header] | None:
    """An example's form values, its family's spec (of the variant sized), released size and
    header (None: no header)."""
    text = path.read_text(encoding="utf-8")
    head = header(text)
    if head is None:
        return None
    values = toml_io.values(toml_io.parse(text, path.name))
    spec, size = estimate.released(str(values.get("model.family", DEFAULT_FAMILY)), head.model)
    return values, spec, size, head


def header_line(path: Path) -> str | None:
    """The `# Memory:` line example `path` should have: its model and GPU, and (a LoRA's) the
    estimated peak of the example as written, so its comment quotes the estimate's figure."""
    found = sized(path)
    if found is None:
        return None
    values, spec, size, head = found
    line = f"# Memory: {size.name} on a {head.gpu} GB GPU"
    if values.get("adapter.type") == "full":
        return line
    setup = estimate.Setup.from_values(values)
    peak = estimate.estimate(size, spec, setup).peak
    clip = f", {setup.frames} frames" if setup.frames > 1 else ""
    return (f"{line}: estimated peak {peak:.1f} GiB ({setup.resolution}x{setup.resolution}"
            f"{clip}, batch {setup.batch}; {estimate.LABEL}).")


def _example_preset(path: Path, gib: int) -> Preset | Refusal | None:
    """The preset of example `path` on `gib` GiB, a refusal, or None (no sizes in its header)."""
    found = sized(path)
    if found is None:
        return None
    values, spec, size, head = found
    full = values.get("adapter.type") == "full"
    if gib > head.gpu or (full and gib != head.gpu):
        reason = (f"a full fine-tune's trained weights need the example's {head.gpu} GB GPU"
                  if full else f"the example is made for {head.gpu} GB")
        return Refusal(path.name, gib, reason)
    made = None if full else estimate.fit(values, size, spec, gib)
    if made is not None and not made.fits:
        return Refusal(path.name, gib, f"needs about {made.estimate.peak:.1f} GiB while "
                       f"{made.estimate.phase} even with "
                       f"{', '.join(made.savers) or 'the example as it is'} (an estimate)")
    text = path.read_text(encoding="utf-8")
    doc = toml_io.parse(text, path.name)
    for key, value in {**(made.changes if made else {}), "save.dir": "."}.items():
        toml_io.set_value(doc, key, value)
    stem = path.name.removesuffix(".toml")
    return Preset(name=f"{stem}-{gib}gib", title=f"{_title(text, stem)} · {gib} GiB",
                  family=spec.name, gib=gib, example=path.name,
                  savers=made.savers if made else [],
                  estimate_gib=round(made.estimate.peak, 1) if made else None,
                  toml=toml_io.dumps(doc))


def _title(text: str, stem: str) -> str:
    """A short title from the example's second header line (`# A FLUX.1-dev LoRA on ...`)."""
    lines = [ln[2:] for ln in text.splitlines()[:3] if ln.startswith("# ")]
    words = lines[1] if len(lines) > 1 else stem
    return re.split(r" (?:on|from|in) |[:(,;]", words, maxsplit=1)[0].removeprefix("A ") \
        .removeprefix("An ").strip()


def tiny_preset(folder: Path | None = None) -> Preset | None:
    """The tiny FLUX.1 preset (CPU demo) on the bundled demo images."""
    path = (folder or examples_dir()) / TINY
    if not path.is_file():
        return None
    doc = toml_io.parse(path.read_text(encoding="utf-8"), TINY)
    demo = demo_dir()
    toml_io.set_value(doc, "datasets[0].subsets[0].path", demo.as_posix())
    toml_io.set_value(doc, "sample.prompts", (demo / "prompts.txt").as_posix())
    toml_io.set_value(doc, "save.dir", ".")
    family = str(toml_io.values(doc).get("model.family", DEFAULT_FAMILY))
    return Preset(name="tiny-flux", title="tiny FLUX.1 (CPU demo)", family=family, gib=None,
                  example=TINY, toml=toml_io.dumps(doc))


def build(folder: Path | None = None) -> tuple[list[Preset], list[Refusal]]:
    """Every preset (the tiny one first) and every example size without one (made again
    only when an example file changed)."""
    folder = folder or examples_dir()
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.toml"))) \
        if folder.is_dir() else ()
    made, refused = _build(folder, stamp)
    return [replace(p, savers=list(p.savers)) for p in made], list(refused)


@functools.lru_cache(maxsize=4)
def _build(folder: Path, stamp: tuple[tuple[str, int], ...]) -> tuple[list[Preset],
                                                                     list[Refusal]]:
    """`build` for one state of the folder (`stamp`: its files and their times)."""
    presets: list[Preset] = []
    refused: list[Refusal] = []
    tiny = tiny_preset(folder)
    if tiny is not None:
        presets.append(tiny)
    for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
        head = header(path.read_text(encoding="utf-8"))
        if head is None:
            continue
        for gib in sorted({*SIZES, head.gpu}, reverse=True):
            made = _example_preset(path, gib)
            if isinstance(made, Preset):
                presets.append(made)
            elif isinstance(made, Refusal) and gib in SIZES:
                refused.append(made)
    return presets, refused


def get(name: str, folder: Path | None = None) -> Preset:
    """The preset called `name`; KeyError when there is none."""
    for preset in build(folder)[0]:
        if preset.name == name:
            return preset
    raise KeyError(name)


def memory_table(folder: Path | None = None) -> str:
    """The README's table of what each example needs per card, from the presets themselves
    (so the README, the app and `check` give one answer; a test keeps it equal)."""
    made, refused = build(folder)
    rows = ["| example | sized for | the example sets | "
            + " | ".join(f"{g} GiB" for g in SIZES) + " |", "|---|---|---|" + "---|" * len(SIZES)]
    for path in sorted((folder or examples_dir()).glob("*.toml")):
        found = sized(path)
        if found is None or found[0].get("adapter.type") == "full":
            continue
        cells = []
        for gib in SIZES:
            preset = next((p for p in made if p.example == path.name and p.gib == gib), None)
            why = next((r.reason for r in refused if r.example == path.name and r.gib == gib),
                       "no preset")
            cells.append(f"{preset.estimate_gib:.1f} GiB: "
                         f"{', '.join(preset.savers) or 'as written'}" if preset else why)
        rows.append(f"| `{path.name}` | {found[2].name} | {_set_savers(found[0])} | "
                    + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _set_savers(values: dict[str, Any]) -> str:
    """The memory savers an example already sets, as `path = value`."""
    on = [f"`{k} = {json.dumps(v)}`" for k, v in sorted(values.items())
          if k in estimate.SAVER_PATHS and v not in (False, 0, "none", "adamw")]
    return ", ".join(on) or "none"


if __name__ == "__main__":  # python -m difftune.ui.forms.presets: the README's memory table
    print(memory_table(), end="")
