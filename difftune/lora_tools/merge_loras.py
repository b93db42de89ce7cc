"""`difftune lora merge A.safetensors --lora B[:w] ... --out OUT`: LoRAs merged into one LoRA.

Modules are matched by their keys (so the files must share a layout: `difftune lora verify`
names it). A module's merged update is the weighted sum of the files' updates; it is written
with the ranks concatenated (down = the downs stacked, up = the weighted, scaled ups side by
side: exactly the sum), or, with `rank`, cut to that rank by SVD (`resize.resize_pair`). The
merged file has alpha = its rank (scale 1) in every module that had an alpha.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.adapters.formats import load_lora_file, save_lora
from difftune.errors import ConfigError
from difftune.lora_tools import kinds
from difftune.lora_tools.factors import Factors, factors, pair_of
from difftune.lora_tools.keys import Module, group
from difftune.lora_tools.merge_base import Merged
from difftune.lora_tools.output import model_file, out_path
from difftune.lora_tools.resize import resize_pair


def _modules(path: Path, weight: float) -> dict[str, tuple[Module, Factors]]:
    """{key stem: (module, its factors at `weight`)} of one LoRA file."""
    tensors, metadata = load_lora_file(path)
    modules, stray = group(tensors)
    if stray:
        raise ConfigError(f"{path}: {stray[0]} is no LoRA tensor; merge reads LoRA files")
    out = {}
    for stem, m in modules.items():
        part = factors(m, weight, kinds.file_alpha(metadata), str(path))
        if not isinstance(part, Factors):
            raise ConfigError(f"{path}: {stem} is a {part.kind}; LoRA + LoRA merges LoRA and "
                              "LoCon modules (merge a LoHa or LoKr into the base model)")
        out[stem] = (m, part)
    return out


def concatenated(parts: list[Factors]) -> Factors:
    """One module's weighted sum as a LoRA of the summed rank (scale 1)."""
    down = torch.cat([p.down.float() for p in parts])
    up = torch.cat([p.up.float() * p.scale for p in parts], dim=1)
    return Factors(down, up, 1.0)


def merge_loras(first: Path, loras: list[tuple[Path, float]], out: Path | None = None,
                rank: int | None = None, overwrite: bool = False) -> Merged:
    """Write the merged LoRA of `first` (weight 1) and `loras` (see the module's doc)."""
    target = out_path(first, out, "merged", overwrite)
    files = [_modules(first, 1.0)] + [_modules(p, w) for p, w in loras]
    stems = sorted({s for f in files for s in f})
    out_tensors: dict[str, torch.Tensor] = {}
    for stem in stems:
        found = [f[stem] for f in files if stem in f]
        module = found[0][0]
        names = pair_of(module)
        assert names is not None  # `factors` refused modules without a LoRA pair
        dtype = module.tensors[names[0]].dtype
        merged = concatenated([part for _, part in found])
        if rank is not None:
            down, up, _ = resize_pair(merged.down, merged.up, 1.0, rank, None)
        else:
            down, up = merged.down, merged.up
        out_tensors[f"{stem}.{names[0]}"] = down.to(dtype)
        out_tensors[f"{stem}.{names[1]}"] = up.to(dtype)
        if any("alpha" in m.tensors for m, _ in found):
            out_tensors[f"{stem}.alpha"] = torch.tensor(float(down.shape[0]))
    meta = {"difftune.merged": ",".join([first.name] + [f"{p.name}:{w}" for p, w in loras])}
    save_lora(target, out_tensors, meta)
    return Merged(str(target), "", len(stems))


def is_lora_file(path: Path) -> bool:
    """Whether a file holds LoRA tensors (its keys end in LoRA factor names)."""
    from safetensors import safe_open

    with safe_open(str(model_file(path, "BASE")), framework="pt", device="cpu") as f:
        return any(group({k: torch.empty(0) for k in f.keys()})[0])
