"""Big tensor sets written in shards, each converted and written on its own.

`safetensors.torch.save_file` serializes one whole dict at once (a host copy of every tensor
it holds), so writing a full fine-tune's weights or optimizer state in one call would need
about twice their size in host memory. Here the tensors are split in shards of at most
`max_bytes`; each shard's tensors are moved to the host and cast only when that shard is
written, and dropped before the next: a save needs the model plus one shard, never twice the
model. A set that fits in one shard is one plain file at the asked path (a LoRA's checkpoint
looks as it always did); a bigger one is `<stem>-00001-of-0000N.safetensors` files and
`<name>.index.json` mapping each tensor to its shard, the layout diffusers and transformers
read (`from_pretrained`) and `read_sharded` reads back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import load_file

from difftune.adapters.formats import write_safetensors

SHARD_BYTES = 2 << 30  # 2 GiB: the host memory one shard's write may take


def index_path(path: Path) -> Path:
    """The index of a sharded set written at `path` (`<name>.index.json`)."""
    return path.with_name(path.name + ".index.json")


def plan(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
         max_bytes: int) -> list[list[str]]:
    """Tensor names in shards of at most `max_bytes` once cast to `dtype` (a tensor bigger
    than that is a shard of its own); the mapping's order is kept."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * (dtype or t.dtype).itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_sharded(path: Path, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
                  max_bytes: int = SHARD_BYTES, metadata: dict[str, str] | None = None,
                  after: Callable[[Path], None] | None = None) -> list[Path]:
    """Write `tensors` (on any device; cast to `dtype` floating ones, when given) at `path`,
    sharded when bigger than `max_bytes`; returns the files written. `after` runs on each
    file once written (a sync to disk)."""
    shards = plan(tensors, dtype, max_bytes)
    if len(shards) == 1:
        _write(path, {n: tensors[n] for n in shards[0]}, dtype, metadata)
        written = [path]
    else:
        stem, total = path.name.removesuffix(".safetensors"), len(shards)
        written, weight_map = [], {}
        for i, names in enumerate(shards, 1):
            part = path.with_name(f"{stem}-{i:05d}-of-{total:05d}.safetensors")
            _write(part, {n: tensors[n] for n in names}, dtype, metadata)
            weight_map |= {n: part.name for n in names}
            written.append(part)
        size = sum(t.numel() * (dtype or t.dtype).itemsize for t in tensors.values())
        index = index_path(path)
        index.write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": weight_map},
                                    indent=1), encoding="utf-8")
        written.append(index)
    for item in written if after else ():
        after(item)
    return written


def _write(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None,
           metadata: dict[str, str] | None) -> None:
    """One shard: its tensors on the host in `dtype`, written, then let go."""
    host = {n: _host(t, dtype) for n, t in tensors.items()}
    write_safetensors(path, host, metadata)


def _host(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A detached, contiguous host tensor (cast to `dtype` if floating); no copy when it is
    one already."""
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def exists(path: Path) -> bool:
    """Whether a set was written at `path` (one file, or an index of shards)."""
    return path.is_file() or index_path(path).is_file()


def read_sharded(path: Path) -> dict[str, torch.Tensor]:
    """The tensors `write_sharded` wrote at `path` (one file, or the shards its index names)."""
    if path.is_file() or not index_path(path).is_file():
        return load_file(str(path))
    index = json.loads(index_path(path).read_text(encoding="utf-8"))
    out: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(index["weight_map"].values()):
        out |= load_file(str(path.with_name(shard)))
    if set(out) != set(index["weight_map"]):
        raise ValueError(f"{index_path(path).name} names other tensors than its shards hold")
    return out
