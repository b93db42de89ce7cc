"""Sampling with one LoRA file of a run, as a `difftune sample` job, into a folder of its own.

"Sample with this LoRA" (the run page, `POST /api/runs/lora-samples`) makes
`<run>/lora-samples/<lora stem>-<n>/` and writes there:

- `run.toml`: the run's `config.resolved.json` as a run file (what the run trained with: the
  same base model, precision and sample defaults), whose `save.dir` stays the run folder;
- `prompts.txt`: each prompt once per seed (`<prompt> --d <seed>`), so image N is line N;
- `lora.json`: the LoRA file, its strength, the seeds and the job's id;

then queues `difftune sample run.toml --lora FILE:STRENGTH --prompts prompts.txt --out
FOLDER`. The images land in that folder alone, never among the run's own samples; each set
is listed with the prompt and seed of every image (read back from its prompts.txt).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomlkit

from difftune.errors import ConfigError
from difftune.families import registry
from difftune.ui import run_outputs as outputs
from difftune.ui.file_cache import StampCache, entries
from difftune.ui.jobs.launch import write_json
from difftune.ui.runs import CONFIG, json_object, readable, resolved_config, run_of
from difftune.ui.security import PathOutsideRoots, Roots

if TYPE_CHECKING:
    from difftune.ui.context import UiContext
    from difftune.ui.jobs.store import Job

FOLDER = "lora-samples"
INFO = "lora.json"
PROMPTS = "prompts.txt"
RUN_FILE = "run.toml"
MAX_PROMPTS, MAX_SEEDS, MAX_PROMPT_CHARS = 64, 16, 2000


class NotALora(ValueError):
    """A path that is not a LoRA file of a run folder (HTTP 404)."""


@dataclass(frozen=True)
class Request:
    """What to sample: prompts (one image per prompt and seed), seeds, the LoRA's strength."""

    prompts: list[str]
    seeds: list[int]
    strength: float

    @classmethod
    def checked(cls, prompts: list[str], seeds: list[int], strength: float) -> "Request":
        """The request with blank prompts dropped; ValueError naming the field otherwise."""
        kept = [p.strip() for p in prompts if p.strip()]
        if not kept:
            raise ValueError("prompts: give at least one prompt (one a line)")
        if len(kept) > MAX_PROMPTS or not 1 <= len(seeds) <= MAX_SEEDS:
            raise ValueError(f"prompts/seeds: at most {MAX_PROMPTS} prompts and 1 to "
                             f"{MAX_SEEDS} seeds")
        for number, text in enumerate(kept, start=1):
            if "#" in text or "\n" in text or len(text) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompts: prompt {number} holds '#' (a comment in a prompt "
                                 f"file), a line break, or more than {MAX_PROMPT_CHARS} "
                                 "characters; remove it")
        if not math.isfinite(strength) or abs(strength) > 10:
            raise ValueError(f"strength: {strength} is not a LoRA weight; give a number "
                             "between -10 and 10 (1 = as trained)")
        return cls(kept, list(seeds), float(strength))

    def lines(self) -> list[str]:
        """The prompt file's lines: every prompt with every seed (a seed given in a prompt's
        own `--d` is replaced: the last option wins)."""
        return [f"{text} --d {seed}" for text in self.prompts for seed in self.seeds]


def parse_seeds(text: str) -> list[int]:
    """Seeds typed as "1, 2 3" (ValueError naming the field for anything else)."""
    parts = text.replace(",", " ").split()
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"seeds: {text!r} is not a list of whole numbers; write e.g. "
                         "'0, 1, 2'") from None


def lora_of(ctx: "UiContext", path: str) -> tuple[Path, Path]:
    """(the LoRA file `path` names, the run folder it belongs to). PathOutsideRoots outside
    the roots; NotALora for anything but a .safetensors file inside a run folder."""
    lora = ctx.roots.resolve(path)
    run_dir = run_of(lora.parent) if lora.is_file() else None
    if lora.suffix != ".safetensors" or run_dir is None:
        raise NotALora(f"{path} is not a LoRA file of a run folder; pick one of the "
                       ".safetensors files the run page lists")
    return lora, run_dir


def expert_pair(lora: Path, run_dir: Path, roots: Roots) -> list[Path]:
    """The files a sample with `lora` loads: for one expert's file of a two-expert model (Wan
    2.2 A14B's `<name>_high_noise`), every expert's file of that save, since a sample runs the
    whole pipeline (the experts' suffixes from the run's family spec); else `lora` alone."""
    model = resolved_config(run_dir, roots).get("model")
    try:
        experts = registry.spec(model["family"], model.get("variant")).experts
    except (TypeError, KeyError, ConfigError):  # no readable model section: the file alone
        return [lora]
    stem = lora.name.removesuffix(".safetensors")
    own = next((e for e in experts if stem.endswith(e.suffix)), None)
    if own is None:
        return [lora]
    pair = [lora.with_name(f"{stem.removesuffix(own.suffix)}{e.suffix}.safetensors")
            for e in experts]
    return pair if all(p.is_file() for p in pair) else [lora]


def _run_file(run_dir: Path, roots: Roots) -> str:
    """The run's resolved config as TOML (TOML has no null: unset fields are left out), its
    `save.dir` the folder the run is in now (a run folder may have been moved or copied since
    it trained), and a `cache.dir` that lay inside the old folder moved along with it."""
    cfg = resolved_config(run_dir, roots)
    save = cfg.get("save")
    if not isinstance(save, dict):
        raise ValueError(f"{run_dir} has no readable {CONFIG}; sampling needs the run's "
                         "config (the run writes it before its first step)")
    old = Path(str(save.get("dir") or run_dir))
    save["dir"] = str(run_dir)
    cache = cfg.get("cache")
    if isinstance(cache, dict) and isinstance(cache.get("dir"), str) \
            and Path(cache["dir"]).is_relative_to(old):
        cache["dir"] = str(run_dir / Path(cache["dir"]).relative_to(old))
    return tomlkit.dumps(_without_nulls(cfg))


def _without_nulls(value: Any) -> Any:
    """`value` with every None dropped (from dicts and lists, recursively)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value if v is not None]
    return value


def _new_folder(run_dir: Path, stem: str, roots: Roots) -> Path:
    """`<run>/lora-samples/<stem>-<n>/`, made, with n one past the highest taken."""
    parent = roots.resolve(run_dir / FOLDER, write=True)
    parent.mkdir(exist_ok=True)
    taken = [int(n) for name in (p.name for p in parent.iterdir())
             if name.startswith(f"{stem}-") and (n := name[len(stem) + 1:]).isdigit()]
    number = max(taken, default=0) + 1
    while True:
        folder = roots.resolve(parent / f"{stem}-{number}", write=True)
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # made meanwhile by another request
            number += 1


def submit(ctx: "UiContext", lora_path: str, request: Request,
           device: str = "default") -> tuple["Job", Path]:
    """Queue a `difftune sample` job for the LoRA at `lora_path`; returns the job and the
    folder its images go to. Nothing is written when the LoRA or the run's config is
    refused; the folder made is removed again when the queue refuses the job."""
    lora, run_dir = lora_of(ctx, lora_path)
    text = _run_file(run_dir, ctx.roots)
    folder = _new_folder(run_dir, lora.stem, ctx.roots)
    try:
        (folder / RUN_FILE).write_text(text, encoding="utf-8")
        (folder / PROMPTS).write_text("".join(f"{line}\n" for line in request.lines()),
                                      encoding="utf-8")
        args = [*(a for f in expert_pair(lora, run_dir, ctx.roots)
                  for a in ("--lora", f"{f}:{request.strength:g}")),
                "--prompts", str(folder / PROMPTS), "--out", str(folder)]
        job = ctx.queue.submit("sample", folder / RUN_FILE, args, device)
    except (OSError, ValueError):
        shutil.rmtree(folder, ignore_errors=True)
        raise
    write_json(folder / INFO, {"lora": str(lora), "strength": request.strength,
                               "seeds": request.seeds, "prompts": request.prompts,
                               "job": job.id})
    return job, folder


@dataclass
class SampleSet:
    """One "sample with this LoRA" folder: the LoRA, strength, seeds, job and images."""

    folder: str
    lora: str | None
    strength: float | None
    seeds: list[int]
    job: int | None
    images: list[outputs.SampleImage] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


_infos: StampCache[dict[str, Any]] = StampCache()


def sample_sets(run_dir: Path, roots: Roots | None = None) -> list[SampleSet]:
    """The run's "sample with this LoRA" folders, newest first, each with its images (their
    prompts and seeds read from its prompts.txt). Folders leading outside `roots` are left
    out; only what changed since the last call is read again."""
    run_dir = Path(run_dir)
    parent = readable(run_dir / FOLDER, run_dir, roots)
    if parent is None:
        return []
    found = []
    for name, entry in entries(parent).items():
        real = readable(parent / name, run_dir, roots) if entry.is_link else parent / name
        if entry.is_dir and real is not None:
            found.append((entry.stamp[1], _sample_set(run_dir / FOLDER / name, real, run_dir,
                                                      roots)))
    return [s for _, s in sorted(found, key=lambda pair: pair[0], reverse=True)]


def _sample_set(folder: Path, real: Path, run_dir: Path, roots: Roots | None) -> SampleSet:
    """One folder's SampleSet (`real`: the folder with its links followed)."""
    info = _infos.get(real / INFO, real / INFO, lambda: json_object(real / INFO)) or {}
    images = outputs.sample_images(folder, run_dir, roots,
                                   outputs.read_prompt_file(real / PROMPTS))
    strength, job = info.get("strength"), info.get("job")
    seeds = info.get("seeds")
    return SampleSet(str(folder), info.get("lora") if isinstance(info.get("lora"), str) else None,
                     float(strength) if isinstance(strength, (int, float)) else None,
                     [s for s in seeds if isinstance(s, int)] if isinstance(seeds, list) else [],
                     job if isinstance(job, int) else None, images)


def refusal_status(err: Exception) -> int:
    """The HTTP status of a refused request: 403 outside the roots, 404 not a LoRA of a run,
    400 for a bad field."""
    if isinstance(err, PathOutsideRoots):
        return 403
    return 404 if isinstance(err, NotALora) else 400
