"""Which expert of a two-expert model (Wan 2.2 A14B) trains at each step, and on which times.

Each optimizer step trains one expert: its times are drawn only from its side of the boundary
(`FlowMatching.window`), so the batch's rows all run that expert (`families/common/experts.py`
routes by timestep as the pipeline does) and only its LoRA gets gradients; the idle expert's
LoRA and optimizer state stay as they are (AdamW skips parameters without a gradient). The
experts take turns every `train.expert_switch_every` steps, in `train.experts`' order. The
turn is a function of the step count alone, so a resumed run continues the alternation
exactly where the stopped one was.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from safetensors import SafetensorError, safe_open

from difftune.config import RunConfig
from difftune.errors import CheckpointError
from difftune.families.base import Family
from difftune.families.common.experts import Experts
from difftune.families.specs import ExpertSpec, FamilySpec

log = logging.getLogger("difftune")
T = TypeVar("T")


@dataclass(frozen=True)
class Turns:
    """The experts that train, in turn order, `every` steps each, split at `boundary` (the
    fraction of the schedule, the pipeline's boundary_ratio)."""

    experts: tuple[ExpertSpec, ...]
    every: int
    boundary: float

    def at(self, done: int) -> ExpertSpec:
        """The expert that trains the step after `done` optimizer steps."""
        return self.experts[(done // self.every) % len(self.experts)]

    def window(self, done: int) -> tuple[float, float]:
        """The times [low, high) that step draws from (the objective's units, 1 = noise)."""
        return self.at(done).window(self.boundary)

    def patterns(self, patterns: list[str]) -> list[str]:
        """LoRA target regexes of one expert's module names, over the trained experts' (the
        two-expert module names them `<part>.<module>`)."""
        parts = "|".join(re.escape(e.part) for e in self.experts)
        return [rf"(?:{parts})\.(?:{p})" for p in patterns]

    def describe(self) -> list[str]:
        """`check`'s lines: each trained expert's timestep range and the alternation."""
        lines = []
        for e in self.experts:
            low, high = e.window(self.boundary)
            side = f"t >= {low:g}" if e.noisy else f"t < {high:g}"
            lines.append(f"expert {e.name} ({e.part}): timesteps {side} of the shifted "
                         f"schedule ({low * 1000:g} to {high * 1000:g} of 1000), its own LoRA "
                         f"file (*{e.suffix}.safetensors)")
        if len(self.experts) > 1:
            order = " -> ".join(e.name for e in self.experts)
            lines.append(f"alternation: {order}, {self.every} step(s) each; the idle expert "
                         "waits in host memory, its LoRA and optimizer state kept")
        else:
            lines.append(f"only expert {self.experts[0].name} trains "
                         "(train.experts); the other is used as it is by samples")
        return lines


def turns(cfg: RunConfig, spec: FamilySpec) -> Turns | None:
    """The run's turns, or None for a model of one denoiser (validated at config load)."""
    if not spec.experts:
        return None
    by_name = {e.name: e for e in spec.experts}
    names = cfg.train.experts or list(by_name)
    boundary = cfg.train.expert_boundary or spec.boundary
    assert boundary is not None, "a spec with experts declares its boundary"
    return Turns(tuple(by_name[n] for n in names), cfg.train.expert_switch_every, boundary)


def set_boundary(cfg: RunConfig, denoiser: object) -> None:
    """Where a two-expert model's pipeline switches: `train.expert_boundary` where set (the
    model's own boundary_ratio otherwise), so samples switch where the run trains apart."""
    if isinstance(denoiser, Experts) and cfg.train.expert_boundary is not None:
        denoiser.ratio = cfg.train.expert_boundary


def trained(cfg: RunConfig, spec: FamilySpec) -> tuple[ExpertSpec, ...]:
    """The experts this run trains, in the spec's order (empty for one denoiser)."""
    names = cfg.train.experts or [e.name for e in spec.experts]
    return tuple(e for e in spec.experts if e.name in names)


def file_suffixes(cfg: RunConfig, spec: FamilySpec) -> tuple[str, ...]:
    """What ends the stems of the files one save writes: one per trained expert
    (`_high_noise`, `_low_noise`), or "" for a model of one denoiser."""
    return tuple(e.suffix for e in trained(cfg, spec)) or ("",)


def expert_part(family: Family, path: Path) -> str | None:
    """The pipeline part a LoRA file of a two-expert model belongs to: the expert its
    metadata names (`difftune.expert`, what difftune writes), else the one whose suffix ends
    its name (`_high_noise`, `_low_noise`, as users name ComfyUI's pair); None for a model of
    one denoiser. Raises `CheckpointError` when neither tells."""
    if not family.experts:
        return None
    try:
        with safe_open(str(path), "pt") as f:  # the header only
            named = (f.metadata() or {}).get("difftune.expert")
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable .safetensors LoRA ({err})") from None
    stem = path.name.removesuffix(".safetensors")
    for e in family.experts:
        if named == e.name or (named is None and stem.endswith(e.suffix)):
            return e.part
    choices = ", ".join(f"*{e.suffix}.safetensors ({e.name})" for e in family.experts)
    raise CheckpointError(f"{path}: which expert of {family.spec.variant} is it for? "
                          f"Neither its metadata (difftune.expert) nor its name says; name it "
                          f"{choices}")


def pair(family: Family, path: Path) -> list[tuple[Path, str]]:
    """A LoRA file of a two-expert model and its twin beside it (the other expert's suffix
    in place of its own, where that file exists), each with its pipeline part."""
    part = expert_part(family, path)
    own = next(e for e in family.experts if e.part == part)
    stem = path.name.removesuffix(".safetensors")
    base = stem.removesuffix(own.suffix) if stem.endswith(own.suffix) else None
    out = [(path, own.part)]
    for e in family.experts:
        twin = path.with_name(f"{base}{e.suffix}.safetensors") if base is not None else None
        if e is not own and twin is not None and twin.is_file():
            out.append((twin, e.part))
        elif e is not own:
            log.warning("%s has no %s twin beside it: expert %s starts from zero", path,
                        e.suffix, e.name)
    return out


def under(named: dict[str, T], prefix: str, part: str) -> dict[str, T]:
    """One expert's LoRA keys (`<prefix>.<module>...`) as the two-expert module names them
    (`<prefix>.<part>.<module>...`)."""
    head = f"{prefix}."
    return {(f"{head}{part}.{k[len(head):]}" if k.startswith(head) else k): v
            for k, v in named.items()}
