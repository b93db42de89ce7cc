"""One safetensors file written tensor by tensor, in another key layout than the model's.

The single files ComfyUI and Forge load hold a model under its original names (BFL's FLUX.1
`double_blocks.*`, SGM's `model.diffusion_model.input_blocks.*`...), some of them fused
(`qkv` = q, k and v stacked) or reordered (BFL's final `adaLN_modulation` is (shift, scale),
diffusers' (scale, shift)). A family declares its layout as a table `Layout`: each file tensor
is `Piece(sources, swap)`, the diffusers tensors concatenated along the first dimension, its
halves swapped when `swap`. `write_layout` then writes the file without ever holding it: the
header is computed from the shapes, and each tensor is built, cast and written on its own, so a
save needs the model plus one tensor, never a second copy of the model.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
           torch.int8: "I8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Piece:
    """One tensor of a single file: diffusers tensors `sources` stacked along dim 0, with
    its two halves (along dim 0) swapped when `swap`, flattened to one dimension when `flat`."""

    sources: tuple[str, ...]
    swap: bool = False
    flat: bool = False


Layout = dict[str, Piece]


def identity_layout(names: list[str], prefix: str = "") -> Layout:
    """The diffusers names themselves (optionally under `prefix`): for families whose single
    file is the diffusers layout."""
    return {prefix + n: Piece((n,)) for n in names}


def build(piece: Piece, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The file tensor `piece` describes, from the model's `state`."""
    parts = [state[s].detach() for s in piece.sources]
    t = parts[0] if len(parts) == 1 else torch.cat(parts)
    if piece.swap:
        a, b = t.chunk(2, dim=0)
        t = torch.cat([b, a])
    return t.reshape(-1) if piece.flat else t


def _shape(piece: Piece, state: Mapping[str, torch.Tensor]) -> list[int]:
    first = list(state[piece.sources[0]].shape)
    shape = [sum(state[s].shape[0] for s in piece.sources), *first[1:]] if first else []
    return [math.prod(shape)] if piece.flat else shape


def write_layout(path: Path, layout: Layout, state: Mapping[str, torch.Tensor],
                 dtype: torch.dtype, metadata: dict[str, str] | None = None) -> Path:
    """Write `layout` built from `state` (floating tensors cast to `dtype`) as one safetensors
    file at `path`, tensor by tensor; the file gets the mode the umask gives a new file."""
    out_dtype = {n: dtype if state[p.sources[0]].is_floating_point() else state[p.sources[0]].dtype
                 for n, p in layout.items()}
    entries = [(name, out_dtype[name], _shape(piece, state)) for name, piece in layout.items()]
    return write_streamed(path, entries, lambda name: build(layout[name], state), metadata)


def write_streamed(path: Path, entries: list[tuple[str, torch.dtype, list[int]]],
                   produce: Callable[[str], torch.Tensor],
                   metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file whose tensors (name, dtype, shape) are made one at a time by
    `produce(name)` (cast to the entry's dtype): the header comes from the entries, so only
    one tensor is ever held. The file gets the mode the umask gives a new file."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape in entries:
        size = dtype.itemsize * math.prod(shape)
        header[name] = {"dtype": _DTYPES[dtype], "shape": shape,
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    with os.fdopen(fd, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, _ in entries:
            t = produce(name).to("cpu", dtype).contiguous()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


def check_complete(layout: Layout, names: list[str], what: str) -> Layout:
    """`layout`, once checked to place every model tensor exactly once (a tensor left out
    would be a file that loads with random or missing weights); an internal error else."""
    used = [s for p in layout.values() for s in p.sources]
    missing, twice = set(names) - set(used), {s for s in used if used.count(s) > 1}
    if missing or twice or set(used) - set(names):
        raise AssertionError(f"the {what} layout does not place each model tensor once "
                             f"(left out: {sorted(missing)[:4]}, twice: {sorted(twice)[:4]})")
    return layout
