"""Original-layout LoRA tables for block-structured transformers (FLUX.1's and Chroma's BFL
layout): which diffusers modules make up each original module, block by block.

A family's `keys.py` declares its rows once (per block list and outside the blocks); building
the table for the blocks a LoRA mentions, fusing a row's diffusers LoRAs into the original
module's single LoRA (zero-padding untrained parts, swapping (shift, scale) row halves, baking
the scale where a reader ignores alphas) and splitting it back are the same for every such
family and live here, used with `common.kohya.fused_to_kohya` / `fused_from_kohya`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from difftune.adapters.formats import LoraPair
from difftune.adapters.fused import fuse_loras, split_fused_lora, zero_lora
from difftune.families.common.kohya import swapped

# One row: (original name, ((diffusers module, output rows as a multiple of the input width),
# ...)), parts in the original module's row order. The width multiple is only used to size
# parts that were not trained and must be filled with zeros.
Row = tuple[str, tuple[tuple[str, int], ...]]

# The rows every BFL-layout transformer shares (FLUX.1 and models built on it, such as Chroma):
# attention and MLP of the double blocks, the fused qkv+MLP input and the output of the single
# blocks. MLP width is 4x the hidden size (BFL's mlp_ratio); it sizes the untrained parts of a
# fused `linear1`. A family adds its own rows (FLUX.1's modulation layers) to these.
BFL_MLP_RATIO = 4
BFL_DOUBLE_BLOCK: tuple[Row, ...] = (
    ("img_attn_qkv", (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1))),
    ("img_attn_proj", (("attn.to_out.0", 1),)),
    ("txt_attn_qkv", (("attn.add_q_proj", 1), ("attn.add_k_proj", 1), ("attn.add_v_proj", 1))),
    ("txt_attn_proj", (("attn.to_add_out", 1),)),
    ("img_mlp_0", (("ff.net.0.proj", BFL_MLP_RATIO),)),
    ("img_mlp_2", (("ff.net.2", 1),)),
    ("txt_mlp_0", (("ff_context.net.0.proj", BFL_MLP_RATIO),)),
    ("txt_mlp_2", (("ff_context.net.2", 1),)),
)
BFL_SINGLE_BLOCK: tuple[Row, ...] = (
    ("linear1", (("attn.to_q", 1), ("attn.to_k", 1), ("attn.to_v", 1),
                 ("proj_mlp", BFL_MLP_RATIO))),
    ("linear2", (("proj_out", 1),)),
)


@dataclass(frozen=True)
class Entry:
    """One original module and the diffusers modules (with output-width multiples) in it."""

    kohya: str
    parts: tuple[tuple[str, int], ...]

    @property
    def modules(self) -> tuple[str, ...]:
        """The diffusers module names, in original row order."""
        return tuple(m for m, _ in self.parts)


@dataclass(frozen=True)
class BlockTable:
    """A family's original layout. `blocks` gives, per block list, (diffusers list name,
    original list name, rows); `non_block` the rows outside the blocks; `swap` the original
    names whose up rows are (shift, scale) where diffusers has (scale, shift); `bake` those
    written with the scale folded into the up factor and alpha = rank."""

    blocks: tuple[tuple[str, str, tuple[Row, ...]], ...]
    non_block: tuple[Row, ...]
    swap: frozenset[str] = frozenset()
    bake: frozenset[str] = frozenset()

    def entries(self, indices: dict[str, set[int]]) -> list[Entry]:
        """The table for the given block indices (by diffusers list name), non-block rows last."""
        out: list[Entry] = []
        for ours, theirs, rows in self.blocks:
            for i in sorted(indices.get(ours, set())):
                out += [Entry(f"{theirs}_{i}_{k}", tuple((f"{ours}.{i}.{m}", w) for m, w in p))
                        for k, p in rows]
        return out + [Entry(k, p) for k, p in self.non_block]

    def entries_for(self, modules: Iterable[str]) -> list[Entry]:
        """The table for the blocks the diffusers module names mention."""
        modules = list(modules)
        return self.entries({ours: {int(m.group(1)) for k in modules
                                    if (m := re.match(rf"^{ours}\.(\d+)\.", k))}
                             for ours, _, _ in self.blocks})

    def table_for(self, names: Iterable[str]) -> dict[str, Entry]:
        """{original name: entry} for the blocks the kohya names (without `lora_unet_`)
        mention."""
        names = list(names)
        indices = {ours: {int(m.group(1)) for k in names
                          if (m := re.match(rf"{theirs}_(\d+)_", k))}
                   for ours, theirs, _ in self.blocks}
        return {e.kohya: e for e in self.entries(indices)}

    def fuse(self, entry: Entry, pairs: dict[str, LoraPair], rank: int, alpha: float
             ) -> LoraPair:
        """The single LoRA of one original module, fused and reordered as that module expects."""
        present = [pairs[m] for m in entry.modules if m in pairs]
        if len(entry.parts) == 1:
            fused = present[0]
        else:
            like = present[0].down
            in_features = like.shape[1]
            parts = [pairs.get(m) or zero_lora(rank, in_features, w * in_features, like, alpha)
                     for m, w in entry.parts]
            fused = fuse_loras(parts)
        if entry.kohya in self.swap:
            fused = swapped(fused)
        if entry.kohya in self.bake:
            fused = fused.baked()
        return fused

    def split(self, entry: Entry, pair: LoraPair) -> dict[str, LoraPair]:
        """One original module's LoRA as diffusers modules, undoing any row swap."""
        if entry.kohya in self.swap:
            pair = swapped(pair)
        if len(entry.parts) == 1:
            return {entry.modules[0]: pair}
        in_features = pair.down.shape[1]
        dims = [w * in_features for _, w in entry.parts]
        return dict(zip(entry.modules, split_fused_lora(pair, dims)))

