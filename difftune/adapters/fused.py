"""LoRAs of fused modules: k LoRAs that read one input joined into one LoRA of a module with
concatenated outputs (kohya's fused qkv layouts), and split back, exactly."""

from __future__ import annotations

import torch

from difftune.adapters.formats import LoraPair
from difftune.errors import CheckpointError


def fuse_loras(parts: list[LoraPair]) -> LoraPair:
    """Fuse k LoRAs that read the same input into one LoRA of a concatenated-output module.

    down = cat(A_i) (k*r x in) and up = block-diag(B_i) ((sum out_i) x k*r), so
    up @ down = cat(B_i @ A_i) exactly. The rank grows k-fold, so alpha is multiplied by k to keep
    alpha/rank, the per-module scale, unchanged. All parts must share rank and alpha (one scale
    for the fused module); parts that differ are first baked to scale 1.
    """
    if not parts:
        raise ValueError("fuse_loras needs at least one LoRA")
    if len({(p.rank, p.alpha) for p in parts}) > 1:
        parts = [p.baked() for p in parts]
        if len({p.rank for p in parts}) > 1:
            parts = [_pad_rank(p, max(q.rank for q in parts)) for p in parts]
    down = torch.cat([p.down for p in parts], dim=0)
    up = torch.block_diag(*[p.up for p in parts])
    return LoraPair(down, up, parts[0].alpha * len(parts))


def _pad_rank(p: LoraPair, rank: int) -> LoraPair:
    """Zero-pad a scale-1 LoRA to a larger rank (same delta): alpha follows the rank."""
    extra = rank - p.rank
    down = torch.cat([p.down, p.down.new_zeros(extra, p.down.shape[1])])
    up = torch.cat([p.up, p.up.new_zeros(p.up.shape[0], extra)], dim=1)
    return LoraPair(down, up, float(rank))


def zero_lora(rank: int, in_features: int, out_features: int, like: torch.Tensor, alpha: float) -> LoraPair:
    """A LoRA with zero delta, used to fill a part of a fused module that was not trained."""
    return LoraPair(like.new_zeros(rank, in_features), like.new_zeros(out_features, rank), alpha)


def split_fused_lora(fused: LoraPair, out_dims: list[int]) -> list[LoraPair]:
    """Split a fused LoRA back into one LoRA per output chunk (`out_dims` rows each).

    When `up` is block-diagonal with equal blocks (what `fuse_loras` writes), each part gets its
    own rows of `down` and its diagonal block of `up`, with alpha / k: the exact inverse. Any other
    fused LoRA (e.g. trained as one module by kohya) is split exactly by sharing the full `down`
    and taking each part's rows of `up`, keeping the fused rank and alpha.
    """
    if sum(out_dims) != fused.up.shape[0]:
        raise CheckpointError(
            f"fused LoRA has {fused.up.shape[0]} output rows but the module parts need {sum(out_dims)} "
            f"({out_dims}); the file was made for a model of a different size."
        )
    k = len(out_dims)
    ups = torch.split(fused.up, out_dims, dim=0)
    if fused.rank % k == 0 and _is_block_diagonal(ups, fused.rank // k):
        r = fused.rank // k
        return [
            LoraPair(fused.down[i * r : (i + 1) * r], ups[i][:, i * r : (i + 1) * r], fused.alpha / k)
            for i in range(k)
        ]
    return [LoraPair(fused.down, up, fused.alpha) for up in ups]


def _is_block_diagonal(ups: tuple[torch.Tensor, ...], r: int) -> bool:
    """True when row-chunk i of `up` is zero outside columns [i*r, (i+1)*r)."""
    for i, up in enumerate(ups):
        outside = torch.cat([up[:, : i * r], up[:, (i + 1) * r :]], dim=1)
        if torch.count_nonzero(outside) > 0:
            return False
    return True


def is_zero(pair: LoraPair) -> bool:
    """True when a LoRA contributes nothing (its up or down factor is all zeros)."""
    return not bool(torch.count_nonzero(pair.up)) or not bool(torch.count_nonzero(pair.down))
