"""What a run folder holds besides its metrics: the sample images (with their prompts' text)
and the weight files and checkpoints (with their safetensors metadata), read from disk alone
for the run page, the compare page and the HTTP API. As in runs.py, each file is read only
when it lies under the app's roots, symbolic links followed (without roots: inside the run
folder); one leading elsewhere is left out."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from difftune.files.names import COMFYUI_DORA
from difftune.ui.runs import readable, resolved_config
from difftune.ui.security import Roots

log = logging.getLogger("difftune")
SAMPLE_NAME = re.compile(r"^(?P<label>.+?)_(?P<index>\d{2,})_(?P<slug>.+)\.png$")
STEP_LABEL = re.compile(r"^step-(\d+)$")
FILE_STEP = re.compile(r"-step(\d+)$")

# --- samples -----------------------------------------------------------------------------------

@dataclass
class SampleImage:
    """One sample image: the step it was drawn at (None for a non-step label), the prompt's
    index in the prompt file at that event, its text, and the file."""

    step: int | None
    index: int
    prompt: str
    label: str
    path: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def _prompt_texts(run_dir: Path, roots: Roots | None) -> list[str]:
    """The prompts of the run's sample prompt file as it is now (empty when it has none, or
    it lies outside `roots`)."""
    from difftune.sample.prompts import PromptSpec, read_prompts

    name = resolved_config(run_dir, roots).get("sample", {}).get("prompts")
    path = readable(Path(name), run_dir, roots) if isinstance(name, str) and name else None
    if path is None or not path.is_file():
        return []
    default = PromptSpec("", "", 64, 64, 1, 0, 1.0, 1.0)
    logger = logging.getLogger("difftune")
    level = logger.level
    logger.setLevel(logging.ERROR)  # a bad line was warned about by the run; not again per poll
    try:
        return [s.prompt for s in read_prompts(path, default)]
    finally:
        logger.setLevel(level)


def _prompt_of(index: int, slug_text: str, prompts: list[str]) -> str:
    """The text of sample `index` whose file name carries `slug_text`.

    File names hold only a slug of the prompt; the prompt file holds the text. The file may
    have been edited since the sample was drawn, so a prompt is taken only when its slug
    matches (at the same index first, then anywhere); otherwise the slug itself, in words.
    """
    from difftune.sample.runner import slug

    if index < len(prompts) and slug(prompts[index]) == slug_text:
        return prompts[index]
    for text in prompts:
        if slug(text) == slug_text:
            return text
    return slug_text.replace("-", " ")


def samples(run_dir: Path, roots: Roots | None = None) -> list[SampleImage]:
    """The run's sample images (grids and images leading outside `roots` left out), by step
    then prompt index."""
    run_dir = Path(run_dir)
    folder = readable(run_dir / "samples", run_dir, roots)
    if folder is None or not folder.is_dir():
        return []
    prompts = _prompt_texts(run_dir, roots)
    out = []
    for path in folder.glob("*.png"):
        match = SAMPLE_NAME.match(path.name)
        if match is None or readable(path, run_dir, roots) is None:
            continue  # a grid (`<label>_grid.png`), a file someone put there, or a link
        label, index = match["label"], int(match["index"])
        step = STEP_LABEL.match(label)
        out.append(SampleImage(int(step[1]) if step else None, index,
                               _prompt_of(index, match["slug"], prompts), label, str(path)))
    return sorted(out, key=lambda s: (s.step is None, s.step or 0, s.label, s.index))


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
    final = named is None and not stem.endswith("-best")  # (validation.keep_best's file)
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


def files(run_dir: Path, roots: Roots | None = None) -> list[RunFile]:
    """The run's LoRA / embedding / model files and its checkpoint folders, by step (final
    files last). Interrupted saves (`.tmp-*` folders) and files or folders leading outside
    `roots` are left out."""
    run_dir = Path(run_dir)
    found = [*run_dir.glob("*.safetensors"), *(run_dir / "embeddings").glob("*.safetensors")]
    weights = [(p, real) for p in found if (real := readable(p, run_dir, roots))]
    out = [_weight_file(p, real) for p, real in weights if real.is_file()]
    ckpts = readable(run_dir / "checkpoints", run_dir, roots)
    if ckpts is not None and ckpts.is_dir():
        out += [_checkpoint(p, run_dir, roots) for p in (run_dir / "checkpoints").glob("step-*")
                if readable(p, run_dir, roots) and p.is_dir()]
    return sorted(out, key=lambda f: (f.final, f.step if f.step is not None else -1,
                                      f.kind, f.path))
