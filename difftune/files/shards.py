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
from typing import Any, Callable, Iterator, Mapping

import torch
from safetensors import safe_open

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


class LazyTensors(Mapping[str, torch.Tensor]):
    """The tensors of one or several safetensors files, each read only when asked for (and
    not kept): a checkpoint of a full fine-tune is checked and put back tensor by tensor,
    never held whole in host memory beside the model."""

    def __init__(self, files: list[Path]) -> None:
        self._where: dict[str, Any] = {}
        for file in files:
            handle = safe_open(str(file), "pt")  # validates the header against the file size
            self._where |= dict.fromkeys(handle.keys(), handle)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def meta(self) -> dict[str, torch.Tensor]:
        """Every tensor as a meta tensor (shape and dtype from the headers, no data read):
        what checks of shapes and dtypes need."""
        out = {}
        for key, handle in self._where.items():
            part = handle.get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(part.get_dtype(), torch.uint8)
            out[key] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
        return out


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def meta(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Shapes and dtypes of `tensors` without reading lazy ones' data."""
    return tensors.meta() if isinstance(tensors, LazyTensors) else tensors


def read_sharded(path: Path) -> LazyTensors:
    """The tensors `write_sharded` wrote at `path` (one file, or the shards its index names),
    read lazily (`LazyTensors`)."""
    if path.is_file() or not index_path(path).is_file():
        return LazyTensors([path])
    index = json.loads(index_path(path).read_text(encoding="utf-8"))
    shards = [path.with_name(shard) for shard in dict.fromkeys(index["weight_map"].values())]
    out = LazyTensors(shards)
    if set(out) != set(index["weight_map"]):
        raise ValueError(f"{index_path(path).name} names other tensors than its shards hold")
    return out
