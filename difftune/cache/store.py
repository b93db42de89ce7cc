"""Cache stores. Entries are dicts of tensors looked up by content key.

`MemoryStore` keeps entries in host memory for the run; `NullStore` keeps nothing (the
"none" setting: values are recomputed when needed); `DiskStore` (cache/disk.py) writes
safetensors files with their inputs in the metadata, behind the same three methods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch


class Store(Protocol):
    """A key -> tensors mapping."""

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry under `key`, or None when absent."""
        ...

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Store an entry; `meta` records the inputs that produced it."""
        ...

    def __contains__(self, key: str) -> bool: ...

    def missing(self, keys: list[str]) -> set[str]:
        """The keys with no (valid) entry: what a fill must compute."""
        ...


class MemoryStore:
    """Entries kept on the CPU for the lifetime of the run."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, torch.Tensor]] = {}

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry, or None."""
        return self._entries.get(key)

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Keep a detached CPU copy of the tensors."""
        self._entries[key] = {k: v.detach().to("cpu") for k, v in tensors.items()}

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def missing(self, keys: list[str]) -> set[str]:
        """The keys not held."""
        return {k for k in keys if k not in self._entries}

    def __len__(self) -> int:
        return len(self._entries)


class NullStore:
    """Stores nothing: every lookup misses."""

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """Always None."""
        return None

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Discard."""

    def __contains__(self, key: str) -> bool:
        return False

    def missing(self, keys: list[str]) -> set[str]:
        """Every key."""
        return set(keys)


def make_store(mode: str, root: Path | None = None, kind: str = "") -> Store:
    """The store for a `cache.latents` / `cache.text` setting ("disk" needs `root` and `kind`)."""
    if mode == "disk":
        from difftune.cache.disk import DiskStore

        assert root is not None and kind, "a disk store needs its folder and kind"
        return DiskStore(root, kind)
    return MemoryStore() if mode == "memory" else NullStore()
