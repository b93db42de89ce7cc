"""What a run folder holds besides its metrics: the sample images (with their prompts' text)
and the weight files and checkpoints (with their safetensors metadata), read from disk alone
for the run page, the compare page and the HTTP API. As in runs.py, each file is read only
when it lies under the app's roots, symbolic links followed (without roots: inside the run
folder); one leading elsewhere is left out."""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftune.files.names import COMFYUI_DORA
from difftune.ui.file_cache import Entry, StampCache, entries
from difftune.ui.runs import readable, resolved_config
from difftune.ui.security import Roots

log = logging.getLogger("difftune")
SAMPLE_NAME = re.compile(r"^(?P<label>.+?)_(?P<index>\d{2,})_(?P<slug>.+)\.png$")
STEP_LABEL = re.compile(r"^step-(\d+)$")
# `<name>-step000123`, and a two-expert model's `<name>-step000123_high_noise` (its pairs' suffix).
FILE_STEP = re.compile(r"-step(\d+)(?:_[a-z]+_noise)?$")
BEST = re.compile(r"-best(?:_[a-z]+_noise)?$")  # validation.keep_best's / save.keep_best's file
WEIGHT_NAME = re.compile(r"^[^.].*\.safetensors$")  # (not a hidden temporary file)
CHECKPOINT_NAME = re.compile(r"^step-")

# --- samples -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class SampleImage:
    """One sample image: the step it was drawn at (None for a non-step label), the prompt's
    index in the prompt file at that event, its text, the file, and its seed when the prompt
    file still holds that prompt (None otherwise: the file was edited since)."""

    step: int | None
    index: int
    prompt: str
    label: str
    path: str
    seed: int | None = None
    # A clip's animated WebP beside its first frame's PNG (None: an image); browsers play it
    # in a plain <img>, so the gallery and the viewer show it in the PNG's place.
    preview: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass(frozen=True)
class Prompt:
    """A prompt of a prompt file as sample file names show it: its text, slug and seed."""

    text: str
    slug: str
    seed: int | None


_prompt_files: StampCache[list[Prompt]] = StampCache()


def read_prompt_file(path: Path, default_seed: int = 0) -> list[Prompt]:
    """The prompts of a prompt file (`sample.prompts`'s format), read again only when the
    file changed; [] when it holds none. A bad line was warned about by the run that read it,
    so it is skipped here without a warning at every poll."""
    return _prompt_files.get((path, default_seed), path,
                             lambda: _parse_prompts(path, default_seed)) or []


def _parse_prompts(path: Path, default_seed: int) -> list[Prompt]:
    """Every usable prompt of `path` with its slug and seed."""
    from difftune.sample.prompts import PromptSpec, read_prompts
    from difftune.sample.runner import slug

    default = PromptSpec("", "", 64, 64, 1, default_seed, 1.0, 1.0)
    logger = logging.getLogger("difftune")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        specs = read_prompts(path, default) if path.is_file() else []
    finally:
        logger.setLevel(level)
    return [Prompt(s.prompt, slug(s.prompt), s.seed) for s in specs]


def run_prompts(run_dir: Path, roots: Roots | None) -> list[Prompt]:
    """The prompts of the run's sample prompt file as it is now (empty when it has none, or
    it lies outside `roots`), with the run's default seed."""
    settings = resolved_config(run_dir, roots).get("sample", {})
    name, seed = settings.get("prompts"), settings.get("seed", 0)
    path = readable(Path(name), run_dir, roots) if isinstance(name, str) and name else None
    if path is None:
        return []
    return read_prompt_file(path, seed if isinstance(seed, int) else 0)


def match_prompt(index: int, slug_text: str, prompts: list[Prompt]) -> tuple[str, int | None]:
    """The text and seed of sample `index` whose file name carries `slug_text`.

    File names hold only a slug of the prompt; the prompt file holds the text. The file may
    have been edited since the sample was drawn, so a prompt is taken only when its slug
    matches (at the same index first, then anywhere); otherwise the slug itself, in words,
    and no seed.
    """
    if index < len(prompts) and prompts[index].slug == slug_text:
        return prompts[index].text, prompts[index].seed
    for prompt in prompts:
        if prompt.slug == slug_text:
            return prompt.text, prompt.seed
    return slug_text.replace("-", " "), None


@dataclass
class _Gallery:
    """The samples of one folder as last made: from which listing and prompts."""

    listing: dict[str, Entry]
    prompts: list[Prompt]
    images: list[SampleImage]


_galleries: dict[tuple[Path, Path, Roots | None], _Gallery] = {}
_galleries_lock = threading.Lock()


def sample_images(folder: Path, run_dir: Path, roots: Roots | None,
                  prompts: list[Prompt]) -> list[SampleImage]:
    """The sample images of `folder` (a run's samples folder, or one `difftune sample`
    wrote), by step then prompt index, each with its prompt's text and seed. Made again
    only when the folder's listing or the prompts changed: an unchanged folder is not even
    listed (see file_cache). Grids and links leading outside `roots` are left out."""
    real = readable(folder, run_dir, roots)
    if real is None:
        return []
    listing = entries(real)
    key = (Path(run_dir), Path(folder), roots)
    with _galleries_lock:
        known = _galleries.get(key)
    if known is not None and known.listing is listing and known.prompts is prompts:
        return known.images
    before = {Path(s.path).name: s for s in known.images} if known is not None \
        and known.prompts is prompts else {}
    out = []
    for name, entry in listing.items():
        image = before.get(name) or _sample(real, entry, run_dir, roots, prompts)
        if image is not None:
            out.append(image)
    out.sort(key=lambda s: (s.step is None, s.step or 0, s.label, s.index))
    with _galleries_lock:
        _galleries[key] = _Gallery(listing, prompts, out)
    return out


def _sample(folder: Path, entry: Entry, run_dir: Path, roots: Roots | None,
            prompts: list[Prompt]) -> SampleImage | None:
    """The SampleImage of one listed file, or None for a grid (`<label>_grid.png`), a file
    someone put there, or a link leading outside `roots` (a plain file of a folder under
    the roots is under them: only links are resolved)."""
    match = SAMPLE_NAME.match(entry.name)
    if match is None or entry.is_dir:
        return None
    path = folder / entry.name
    if entry.is_link and readable(path, run_dir, roots) is None:
        return None
    label, index = match["label"], int(match["index"])
    step = STEP_LABEL.match(label)
    text, seed = match_prompt(index, match["slug"], prompts)
    webp = path.with_suffix(".webp")  # written before the PNG (sample/video.py)
    preview = str(webp) if webp.is_file() and not webp.is_symlink() else None
    return SampleImage(int(step[1]) if step else None, index, text, label, str(path), seed,
                       preview)


def samples(run_dir: Path, roots: Roots | None = None) -> list[SampleImage]:
    """The run's sample images (grids and images leading outside `roots` left out), by step
    then prompt index; the same list object while nothing changed (do not modify it)."""
    run_dir = Path(run_dir)
    return sample_images(run_dir / "samples", run_dir, roots, run_prompts(run_dir, roots))


# --- checkpoints and weight files ------------------------------------------------------------

@dataclass
class RunFile:
    """A file (or checkpoint folder) a run wrote that a user downloads or resumes from.

    `kind`: "lora", "embedding", "model" (a full fine-tune's single file) or "checkpoint"
    (a folder; `complete` when its state.json exists, i.e. it can be resumed from). `metadata`
    is the safetensors header metadata (a checkpoint shows its LoRA file's); `size` in bytes
    (a folder's files summed); `step` from the metadata or the name, None for the final file.
    """

    kind: str
    path: str
    step: int | None
    size: int
    metadata: dict[str, str] = field(default_factory=dict)
    complete: bool = True
    final: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def header_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header ({} when it has none or is not one)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {})
    except (OSError, SafetensorError) as err:  # a damaged or half-written file: listed, without metadata
        log.debug("safetensors header of %s unreadable: %s", path, err)
        return {}


def _kind(meta: dict[str, str]) -> str:
    """What a weight file is, from the metadata difftune writes into it."""
    if "difftune.placeholder" in meta:
        return "embedding"
    if "difftune.rank" in meta or "ss_network_dim" in meta:
        return "lora"
    return "model"


def _weight_file(path: Path, real: Path) -> RunFile:
    """A RunFile for one .safetensors file (`real`: it with its links followed)."""
    meta = header_metadata(real)
    stem = path.stem.removesuffix(COMFYUI_DORA)  # a DoRA run's ComfyUI file: as its twin
    named = FILE_STEP.search(stem)
    steps = meta.get("difftune.steps")
    step = int(named[1]) if named else int(steps) if steps and steps.isdigit() else None
    final = named is None and BEST.search(stem) is None
    return RunFile(_kind(meta), str(path), step, real.stat().st_size, meta, final=final)


def _checkpoint(folder: Path, run_dir: Path, roots: Roots | None) -> RunFile:
    """A RunFile for one checkpoint folder (its files leading outside `roots` left out)."""
    from difftune.train.checkpoint.files import lora_file

    held = [real for p in folder.rglob("*") if (real := readable(p, run_dir, roots))]
    size = sum(p.stat().st_size for p in held if p.is_file())
    step = STEP_LABEL.match(folder.name)
    lora = readable(lora_file(folder), run_dir, roots)
    meta = header_metadata(lora) if lora is not None and lora.is_file() else {}
    return RunFile("checkpoint", str(folder), int(step[1]) if step else None, size, meta,
                   complete=(folder / "state.json").is_file())


# Each file or checkpoint folder is read again only when its stamp changed (a checkpoint is
# written aside and renamed into place: a new folder); see file_cache.
_weights: StampCache[RunFile] = StampCache()
_checkpoints: StampCache[RunFile] = StampCache()


def _listed(folder: Path, pattern: re.Pattern[str], dirs: bool, run_dir: Path,
            roots: Roots | None) -> list[tuple[Path, Path]]:
    """(path, real path) of the entries of `folder` whose name matches `pattern` (folders
    when `dirs`, else files), leaving out those that lead outside `roots`."""
    real = readable(folder, run_dir, roots)
    if real is None:
        return []
    out = []
    for name, entry in entries(real).items():
        if entry.is_dir != dirs or not pattern.match(name):
            continue
        held = readable(folder / name, run_dir, roots) if entry.is_link else real / name
        if held is not None:
            out.append((folder / name, held))
    return out


def files(run_dir: Path, roots: Roots | None = None) -> list[RunFile]:
    """The run's LoRA / embedding / model files and its checkpoint folders, by step (final
    files last). Interrupted saves (`.tmp-*` folders) and files or folders leading outside
    `roots` are left out. Only what changed since the last call is read again."""
    run_dir = Path(run_dir)
    found = [*_listed(run_dir, WEIGHT_NAME, False, run_dir, roots),
             *_listed(run_dir / "embeddings", WEIGHT_NAME, False, run_dir, roots)]
    out = [f for p, real in found
           if (f := _weights.get((p, real), real, lambda: _weight_file(p, real))) is not None]
    for p, real in _listed(run_dir / "checkpoints", CHECKPOINT_NAME, True, run_dir, roots):
        ckpt = _checkpoints.get((p, real, roots), real, lambda: _checkpoint(p, run_dir, roots))
        if ckpt is not None:
            out.append(ckpt)
    return sorted(out, key=lambda f: (f.final, f.step if f.step is not None else -1,
                                      f.kind, f.path))
