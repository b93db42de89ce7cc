"""`difftune lora resize FILE --rank R | --energy E`: a LoRA at another rank, by SVD per module.

Each module's update `delta = scale * up @ down` (a conv's factors flattened past their first
axis) is factored exactly through QR of both factors (`up = Qu Ru`, `down^T = Qd Rd`, so
`delta = Qu (scale Ru Rd^T) Qd^T` and the SVD of the small rank x rank middle gives delta's),
then cut to the `rank` largest singular values, or to the fewest holding the share `energy` of
the squared norm. The new factors carry sqrt(S) each, with alpha = the new rank (scale 1, the
old scale folded in); a DoRA magnitude is kept as it is (its direction is what is resized).
Keys, spelling and dtypes stay the input's; LoHa, LoKr and full diffs are refused.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from difftune.adapters.formats import load_lora_file, save_lora
from difftune.errors import ConfigError
from difftune.lora_tools import kinds
from difftune.lora_tools.factors import pair_of
from difftune.lora_tools.keys import group
from difftune.lora_tools.output import out_path

RESIZABLE = (kinds.LORA, kinds.LOCON, kinds.DORA)


@dataclass
class Resized:
    """What `resize` did: the file written and each module's old rank, new rank and the
    share of its update's squared norm kept."""

    path: str
    modules: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


def svd_factors(down: torch.Tensor, up: torch.Tensor, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U, S, Vh) of `scale * up @ down` (2-D, float64), computed through the rank-sized core."""
    qu, ru = torch.linalg.qr(up.double())
    qd, rd = torch.linalg.qr(down.double().T)
    u, s, vh = torch.linalg.svd(scale * ru @ rd.T, full_matrices=False)
    return qu @ u, s, vh @ qd.T


def keep(s: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """How many singular values to keep: `rank` (at most all), or the fewest whose squares
    hold the share `energy` of the total (at least one)."""
    if rank is not None:
        return max(1, min(rank, int(s.numel())))
    share = torch.cumsum(s**2, 0) / max(float((s**2).sum()), 1e-300)
    return int(min(int((share < float(energy) - 1e-12).sum()) + 1, s.numel()))


def resize_pair(down: torch.Tensor, up: torch.Tensor, scale: float, rank: int | None,
                energy: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """New (down, up) in the input's shapes past the rank axis and dtypes, and the kept share."""
    u, s, vh = svd_factors(down.flatten(1), up.flatten(1), scale)
    k = keep(s, rank, energy)
    root = s[:k].sqrt()
    new_up = (u[:, :k] * root).reshape(up.shape[0], k, *up.shape[2:]).to(up.dtype)
    new_down = (root[:, None] * vh[:k]).reshape(k, *down.shape[1:]).to(down.dtype)
    total = float((s**2).sum())
    return new_down.contiguous(), new_up.contiguous(), (float((s[:k] ** 2).sum()) / total
                                                        if total else 1.0)


def resize_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                   rank: int | None, energy: float | None, label: str
                   ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, int, float]]]:
    """Every module of a file resized (`label` names the file in errors)."""
    modules, stray = group(tensors)
    out = {key: tensors[key] for key in stray}
    report: dict[str, tuple[int, int, float]] = {}
    default = kinds.file_alpha(metadata)
    for stem, module in modules.items():
        kind = kinds.kind(module.tensors)
        pair = pair_of(module)
        if kind not in RESIZABLE or pair is None:
            raise ConfigError(f"{label}: {stem} is a {kind}; resize works on LoRA, LoCon and "
                              "DoRA modules only (a LoHa or LoKr has no single low-rank factor "
                              "pair to cut)")
        down, up = module.tensors[pair[0]], module.tensors[pair[1]]
        old = int(down.shape[0])
        alpha = kinds.alpha(module.tensors, default)
        new_down, new_up, kept = resize_pair(down, up, (alpha or old) / old, rank, energy)
        for name, value in module.tensors.items():
            out[f"{stem}.{name}"] = value
        out[f"{stem}.{pair[0]}"], out[f"{stem}.{pair[1]}"] = new_down, new_up
        if "alpha" in module.tensors:
            out[f"{stem}.alpha"] = torch.tensor(float(new_down.shape[0]),
                                                dtype=module.tensors["alpha"].dtype)
        report[stem] = (old, int(new_down.shape[0]), kept)
    return out, report


def resized_metadata(metadata: dict[str, str], ranks: list[int]) -> dict[str, str]:
    """The input's metadata with the new rank (alpha = rank: the scale is folded in);
    diffusers' adapter config is left out (it would state the old rank; diffusers infers
    rank from the shapes and alpha = rank without it)."""
    out = {k: v for k, v in metadata.items() if k != "lora_adapter_metadata"}
    if ranks:
        out["ss_network_dim"] = str(max(ranks))
        out["ss_network_alpha"] = str(float(max(ranks))) if len(set(ranks)) == 1 else "dynamic"
    out["difftune.resized_ranks"] = ",".join(sorted({str(r) for r in ranks}, key=int))
    return out


def resize_file(path: str | os.PathLike[str], rank: int | None = None,
                energy: float | None = None, out: Path | None = None,
                overwrite: bool = False) -> Resized:
    """Write the resized LoRA (see the module's doc) and report each module's ranks and kept
    energy. Exactly one of `rank` (>= 1) or `energy` (in (0, 1]) is given."""
    source = Path(path)
    if (rank is None) == (energy is None):
        raise ConfigError("give exactly one of --rank R or --energy E")
    if rank is not None and rank < 1 or energy is not None and not 0 < energy <= 1:
        raise ConfigError("--rank must be at least 1 and --energy in (0, 1], e.g. 0.9")
    target = out_path(source, out, f"r{rank}" if rank is not None else f"e{energy}", overwrite)
    tensors, metadata = load_lora_file(source)
    new, report = resize_tensors(tensors, metadata, rank, energy, str(source))
    save_lora(target, new, resized_metadata(metadata, [r[1] for r in report.values()]))
    return Resized(str(target), report)
