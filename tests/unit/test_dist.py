"""How work is split between the processes of a data-parallel run (no process group needed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from difftune.cache.store import MemoryStore
from difftune.config import load_config
from difftune.train.dist import Dist
from difftune.train.setup import prepare, share_cache

from ..e2e.conftest import images, run_toml  # noqa: F401


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 8])
def test_shares_and_rows_cover_everything_once(world: int, n: int) -> None:
    items = list(range(n))
    shares = [Dist(r, world).share(items) for r in range(world)]
    assert sorted(x for s in shares for x in s) == items
    rows = [items[Dist(r, world).rows(n)] for r in range(world)]
    assert [x for r in rows for x in r] == items  # contiguous, in rank order
    assert max(map(len, rows)) - min(map(len, rows)) <= 1


class CountingStore(MemoryStore):
    """A memory store that counts how often each key is written."""

    def __init__(self) -> None:
        super().__init__()
        self.puts: dict[str, int] = {}

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        self.puts[key] = self.puts.get(key, 0) + 1
        super().put(key, tensors, meta)


@dataclass(frozen=True)
class FakeDist(Dist):
    """Two ranks in one process: `gather` returns what the test planted for every rank."""

    planted: tuple[Any, ...] = ()

    def gather(self, obj: Any) -> list[Any]:
        return [obj if r == self.rank else self.planted[r] for r in range(self.world)]


def test_each_cache_entry_is_computed_by_exactly_one_process(tmp_path: Path,
                                                             images: Path) -> None:  # noqa: F811
    cfg = load_config(run_toml(tmp_path, images), ["datasets.0.flip=true"])
    run = prepare(cfg, show_progress=False)
    stores, computed = [], []
    for rank in (0, 1):
        store = CountingStore()
        run.latents.store = store
        computed.append(run.latents.fill(share=Dist(rank, 2).share))
        stores.append(store)
    wanted = run.latents.keys()
    assert len(wanted) == 12  # 6 images, both flips
    assert set(computed[0]) | set(computed[1]) == wanted
    assert not set(computed[0]) & set(computed[1])
    assert all(n == 1 for s in stores for n in s.puts.values())
    # Memory caches are then exchanged: every process ends up holding every entry.
    entries = [{k: s.get(k) for k in c} for s, c in zip(stores, computed)]
    for rank in (0, 1):
        share_cache(stores[rank], computed[rank], FakeDist(rank, 2, tuple(entries)))
        assert set(stores[rank]._entries) == wanted
        assert all(n == 1 for n in stores[rank].puts.values())  # received entries put once


def test_the_launch_command_drops_only_num_processes() -> None:
    from difftune.verbs.launch import command, without_num_processes

    argv = ["train", "run.toml", "--num-processes", "4", "--set", "train.lr=1e-4",
            "--num-processes=4", "--resume", "latest"]
    assert without_num_processes(argv) == ["train", "run.toml", "--set", "train.lr=1e-4",
                                           "--resume", "latest"]
    cmd = command(4, argv)
    assert cmd[1:5] == ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes"]
    assert cmd[5] == "4" and cmd[-8:] == ["-m", "difftune", "train", "run.toml", "--set",
                                          "train.lr=1e-4", "--resume", "latest"]
