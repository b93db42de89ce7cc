"""`difftune lora extract --base BASE --tuned TUNED --rank R`: a LoRA from two models' difference.

BASE and TUNED are files of one family's denoiser in the same layout (two single files, or two
diffusers-named files). Each weight matrix (a conv's flattened past its first axis) that
differs is factored by SVD and cut to `rank`: up = U sqrt(S), down = sqrt(S) Vh, scale 1
(alpha = rank where the spelling carries alphas). Files are read with safetensors' safe_open
one tensor pair at a time, so host memory stays near two tensors (and the LoRA). The LoRA is
spelled the way most programs read the base's naming (`programs`: ComfyUI, diffusers, Forge),
e.g. `lora_unet_<original name>` for a FLUX.1 single file; biases and norms are not carried
(a LoRA has no place for them) and are counted in the report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from difftune.adapters.formats import save_lora
from difftune.errors import ConfigError
from difftune.families import registry
from difftune.lora_tools.merge_base import base_naming
from difftune.lora_tools.names import DIFFUSERS, FamilyNames, family_names
from difftune.lora_tools.output import model_file, out_path
from difftune.lora_tools.programs import programs


@dataclass
class Extracted:
    """What `extract` did: the file, the family, each module's kept energy, what it left."""

    path: str
    family: str
    spelling: str
    modules: dict[str, float] = field(default_factory=dict)
    not_carried: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


def best_spelling(family: str, naming: str) -> str:
    """The prefix over `naming` that the most programs read in full (ties: the first)."""
    counts: dict[str, int] = {}
    for program in programs(family):
        for rule in program.rules:
            if rule.naming == naming and not rule.skips:
                counts[rule.prefix] = counts.get(rule.prefix, 0) + 1
    if not counts:
        other = "diffusers-named denoiser file (a folder's transformer/ weights)" \
            if naming != DIFFUSERS else "denoiser's single file"
        raise ConfigError(f"no program reads {family} LoRAs in {naming} names in full, so a "
                          f"LoRA extracted from this file would not load; pass the {other}")
    return max(counts, key=lambda p: counts[p])


def which_family(keys: list[str], family: str | None) -> tuple[str, FamilyNames, str, str]:
    """(family, its names, root, naming) of a base file's keys (`family` forces one)."""
    scored = []
    for name in [family] if family else registry.names():
        names = family_names(name)
        try:
            root, naming = base_naming(keys, names)
        except ConfigError:
            continue
        hits = sum(1 for k in keys if k.startswith(root) and k.endswith(".weight") and
                   names.naming(naming).resolve(k[len(root):-len(".weight")], False))
        scored.append((hits, -len(names.pieces), name, names, root, naming))
    if not scored:
        raise ConfigError("--base holds no denoiser weights of a family difftune knows; pass "
                          "the denoiser's single file or diffusers-named file (--family)")
    return max(scored, key=lambda s: s[:2])[2:]


def low_rank(diff: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, kept share of the squared norm) of the best rank-`rank` cut of `diff`."""
    matrix = diff.float().flatten(1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    k = min(rank, int(s.numel()))
    root = s[:k].sqrt()
    up = (u[:, :k] * root).reshape(diff.shape[0], k, *[1] * (diff.ndim - 2))
    down = (root[:, None] * vh[:k]).reshape(k, *diff.shape[1:])
    total = float((s**2).sum())
    return down.contiguous(), up.contiguous(), float((s[:k] ** 2).sum()) / total if total else 1.0


def _lora_keys(prefix: str, module: str, down: torch.Tensor, up: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """One module's LoRA tensors in `prefix`'s spelling (kohya names and alpha after "_")."""
    if prefix.endswith("_"):
        stem = prefix + module.replace(".", "_")
        return {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                f"{stem}.alpha": torch.tensor(float(down.shape[0]))}
    return {f"{prefix}{module}.lora_A.weight": down, f"{prefix}{module}.lora_B.weight": up}


def extract(base: Path, tuned: Path, rank: int, out: Path | None = None,
            family: str | None = None, overwrite: bool = False) -> Extracted:
    """Write the LoRA of TUNED - BASE (see the module's doc), in TUNED's precision."""
    if rank < 1:
        raise ConfigError("--rank must be at least 1")
    model_file(base, "--base")
    target = out_path(model_file(tuned, "--tuned"), out, f"lora-r{rank}", overwrite)
    with safe_open(str(base), "pt", device="cpu") as b, \
            safe_open(str(tuned), "pt", device="cpu") as t:
        keys = list(b.keys())
        if set(keys) != set(t.keys()):
            odd = sorted(set(keys) ^ set(t.keys()))[0]
            raise ConfigError(f"--base {base} and --tuned {tuned} hold different tensors "
                              f"({odd} is in one only); pass two files of the same layout")
        name, names, root, naming = which_family(keys, family)
        prefix = best_spelling(name, naming)
        report, lora = Extracted(str(target), name, f"{prefix}<{naming} name>"), {}
        dtype = torch.float32
        for key in keys:
            before, after = b.get_tensor(key), t.get_tensor(key)
            if before.shape != after.shape:
                raise ConfigError(f"{key} has shape {tuple(before.shape)} in --base and "
                                  f"{tuple(after.shape)} in --tuned: not the same model")
            if not before.is_floating_point() or torch.equal(before, after):
                continue
            module = key[len(root):].removesuffix(".weight")
            if before.ndim < 2 or not key.startswith(root) or \
                    not names.naming(naming).resolve(module, False):
                report.not_carried.append(key)
                continue
            down, up, kept = low_rank(after.float() - before.float(), rank)
            dtype = after.dtype
            lora |= _lora_keys(prefix, module, down, up)
            report.modules[module] = kept
    if not lora:
        raise ConfigError(f"--tuned {tuned} has no weight matrix that differs from --base")
    save_lora(target, lora, {"difftune.extracted": f"rank {rank} from {base.name}, "
                             f"{tuned.name}"}, dtype=dtype)
    return report
