"""DiskStore: round trips, corruption detection, pruning, concurrent writers, killed writers."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from difftune.cache.disk import DiskStore
from difftune.errors import EnvironmentProblem

REPO = Path(__file__).resolve().parents[2]


def K(i: int) -> str:
    """A realistic key (sha256 hex)."""
    return hashlib.sha256(str(i).encode()).hexdigest()


def entry(i: int) -> dict[str, torch.Tensor]:
    """Deterministic tensors for entry `i` (identical in every process)."""
    return {"x": torch.arange(64, dtype=torch.float32).reshape(4, 16) + i,
            "y": (torch.arange(10) * 0.5 + i).to(torch.bfloat16)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def layout(path: Path) -> tuple[int, int]:
    """(header length n, total size) of a safetensors file."""
    blob = path.read_bytes()
    return int.from_bytes(blob[:8], "little"), len(blob)


@pytest.fixture
def store(tmp_path: Path) -> DiskStore:
    return DiskStore(tmp_path, "latents")


def test_round_trip_keeps_dtypes_values_and_metadata(store: DiskStore, tmp_path: Path) -> None:
    base = torch.randn(8, 6)
    tensors = {
        "f32": base,
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).half(),
        "i64": torch.arange(5),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "transposed": base.T,  # not contiguous
        "grad": torch.ones(2, requires_grad=True),
    }
    key = K(1)
    assert store.get(key) is None and key not in store and len(store) == 0
    assert not (tmp_path / "latents").exists()  # folders are created lazily
    store.write(key, tensors, {"family": "flux", "image_sha256": "abc"})
    assert store.path(key) == tmp_path / "latents" / key[:2] / f"{key}.safetensors"
    assert store.path(key).is_file() and key in store and len(store) == 1
    assert list(store.keys()) == [key]
    got = store.get(key)
    assert got is not None
    expect = {k: v.detach().contiguous() for k, v in tensors.items()}
    assert same(got, expect)
    assert got["bf16"].dtype == torch.bfloat16 and all(t.device.type == "cpu" for t in got.values())
    meta = store.meta(key)
    assert meta is not None and meta["family"] == "flux" and meta["image_sha256"] == "abc"
    assert meta["difftune.key"] == key
    n, size = layout(store.path(key))
    assert meta["difftune.crc32"] == str(zlib.crc32(store.path(key).read_bytes()[8 + n:]))
    assert store.report() is None and store.meta(K(2)) is None


def test_put_skips_valid_entry_and_rewrites_bad_one(store: DiskStore) -> None:
    key = K(1)
    store.write(key, entry(1), {})
    ino = store.path(key).stat().st_ino
    store.write(key, entry(1), {})
    assert store.path(key).stat().st_ino == ino  # a valid entry is not rewritten
    store.path(key).write_bytes(b"junk")
    store.write(key, entry(1), {})
    assert same(store.get(key), entry(1))
    assert store.report() is None  # rewriting in put is not a recompute after a bad read


def test_keys_must_be_hex(store: DiskStore) -> None:
    for bad in ("../../etc/passwd", "A" * 64, "", "x"):
        with pytest.raises(ValueError):
            store.path(bad)


def test_truncated_entries_are_dropped_and_reported_once(store: DiskStore) -> None:
    key = K(7)
    store.write(key, entry(7), {"i": "7"})
    n, size = layout(store.path(key))
    data = size - 8 - n
    full = store.path(key).read_bytes()
    for cut in (0, 3, 8, 8 + n // 2, 8 + n, 8 + n + data // 2, size - 1):
        store.path(key).write_bytes(full[:cut])
        assert store.get(key) is None, cut
        assert not store.path(key).exists(), cut
        msg = store.report()
        assert msg is not None and msg.count(str(store.path(key))) == 1, (cut, msg)
        assert msg.startswith("1 corrupt or truncated cache entry")
        assert store.report() is None
    store.path(key).write_bytes(full)
    assert same(store.get(key), entry(7))


def test_report_summarises_many(store: DiskStore) -> None:
    for i in range(3):
        store.write(K(i), entry(i), {})
        store.path(K(i)).write_bytes(store.path(K(i)).read_bytes()[:-1])
        assert store.get(K(i)) is None
    msg = store.report()
    assert msg is not None and msg.startswith("3 corrupt or truncated cache entries under ")
    assert str(store.path(K(0))) in msg and str(store.path(K(1))) not in msg
    assert store.report() is None


def test_flipped_data_byte_is_caught_by_crc(store: DiskStore) -> None:
    key = K(3)
    store.write(key, entry(3), {})
    blob = bytearray(store.path(key).read_bytes())
    n, size = layout(store.path(key))
    blob[8 + n + 5] ^= 0x01
    store.path(key).write_bytes(bytes(blob))
    assert key in store  # `in` checks the header and size only, never the data
    assert store.get(key) is None and not store.path(key).exists()
    assert store.report() is not None


@pytest.mark.parametrize("content", [
    b"",
    b"\x00" * 8,
    os.urandom(300),
    (16).to_bytes(8, "little") + b"not json at all!" + b"\x00" * 32,
    (2).to_bytes(8, "little") + b"[]",
    (2).to_bytes(8, "little") + b"{}",
])
def test_garbage_and_empty_files(store: DiskStore, content: bytes) -> None:
    key = K(4)
    store.path(key).parent.mkdir(parents=True)
    store.path(key).write_bytes(content)
    assert store.get(key) is None and not store.path(key).exists()
    assert store.report() is not None and store.report() is None
    store.path(key).write_bytes(content)
    assert key not in store and not store.path(key).exists()
    assert store.report() is not None


def test_entry_under_another_key_is_refused(store: DiskStore) -> None:
    a, b = K(1), K(2)
    store.write(a, entry(1), {})
    store.path(b).parent.mkdir(parents=True, exist_ok=True)
    store.path(b).write_bytes(store.path(a).read_bytes())
    assert store.get(b) is None and not store.path(b).exists()
    store.path(b).write_bytes(store.path(a).read_bytes())
    assert b not in store and not store.path(b).exists()
    assert same(store.get(a), entry(1))


def test_contains_detects_truncation_without_data(store: DiskStore) -> None:
    key = K(5)
    store.write(key, entry(5), {})
    path = store.path(key)
    path.write_bytes(path.read_bytes()[:-3])
    assert key not in store and not path.exists()
    msg = store.report()
    assert msg is not None and str(path) in msg


def test_prune(store: DiskStore) -> None:
    keys = [K(i) for i in range(6)]
    for i, k in enumerate(keys):
        store.write(k, entry(i), {})
    keep = set(keys[:2])
    gone = keys[2:]
    expect_bytes = sum(store.path(k).stat().st_size for k in gone)
    old_tmp = store.dir / "zz" / ".tmp-1-old"
    new_tmp = store.dir / "yy" / ".tmp-1-new"
    for p in (old_tmp, new_tmp):
        p.parent.mkdir(parents=True)
        p.write_bytes(b"x" * 100)
    stale = time.time() - 2 * 3600
    os.utime(old_tmp, (stale, stale))
    assert store.prune(keep) == (len(gone) + 1, expect_bytes + 100)
    assert set(store.keys()) == keep and len(store) == 2
    assert all(same(store.get(k), entry(i)) for i, k in enumerate(keys[:2]))
    assert not old_tmp.exists() and not old_tmp.parent.exists()  # empty shard removed
    assert new_tmp.exists()
    for k in gone:
        if k[:2] not in {x[:2] for x in keep}:
            assert not store.path(k).parent.exists()
    assert store.prune(keep) == (0, 0)
    assert DiskStore(store.dir.parent / "nowhere", "text").prune(set()) == (0, 0)


def _hammer(root: str, seed: int) -> None:
    """Put/get the same 50 keys as a sibling process; unlink some to force real rewrites."""
    store = DiskStore(Path(root), "latents")
    rng = random.Random(seed)
    order = list(range(50)) if seed == 0 else list(range(49, -1, -1))
    for rnd in range(4):
        for i in order:
            store.write(K(i), entry(i), {"i": str(i)})
            j = rng.randrange(50)
            got = store.get(K(j))
            assert got is None or same(got, entry(j)), j
            if rnd < 3 and rng.random() < 0.5:
                try:
                    store.path(K(rng.randrange(50))).unlink()
                except FileNotFoundError:
                    pass
    assert store.bad == [], store.bad


def test_two_processes_writing_the_same_keys(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_hammer, args=(str(tmp_path), s)) for s in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    store = DiskStore(tmp_path, "latents")
    assert set(store.keys()) == {K(i) for i in range(50)}
    assert all(same(store.get(K(i)), entry(i)) for i in range(50))
    assert store.report() is None
    assert not [p for p in tmp_path.rglob(".tmp-*")]


WRITER = """
import hashlib, sys, torch
from pathlib import Path
from difftune.cache.disk import DiskStore
from difftune.errors import EnvironmentProblem
store = DiskStore(Path(sys.argv[1]), "latents")
i = 0
while True:
    store.write(hashlib.sha256(str(i).encode()).hexdigest(),
              {"x": torch.full((256, 512), float(i))}, {"i": str(i)})
    i += 1
"""


def test_killed_writer_leaves_only_valid_entries(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=env,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.rglob("*.safetensors"))) < 15:
            if proc.poll() is not None:
                pytest.fail(f"writer exited early: {proc.stderr.read().decode()}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        proc.kill()  # SIGKILL
        proc.wait()
    store = DiskStore(tmp_path, "latents")
    # a write cut off mid-way, as the kill may or may not have produced one
    first = next(tmp_path.rglob("*.safetensors"))
    (first.parent / f".tmp-{proc.pid}-cut").write_bytes(first.read_bytes()[:1000])
    keys = list(store.keys())
    assert len(keys) >= 15 and not any(k.startswith(".") for k in keys)
    by_key = {K(i): i for i in range(len(keys) + 5)}
    for k in keys:
        got = store.get(k)
        assert got is not None and torch.equal(got["x"], torch.full((256, 512), float(by_key[k])))
    assert store.report() is None


def test_put_is_queued_readable_at_once_and_flushed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, "latents")
    keys = [K(i) for i in range(100)]  # more than the queue holds
    for i, key in enumerate(keys):
        store.put(key, entry(i), {"i": str(i)})
        assert key in store and torch.equal(store.get(key)["x"], entry(i)["x"])
    store.flush()
    assert sorted(store.keys()) == sorted(keys) and not store._pending
    assert all(torch.equal(store.get(k)["x"], entry(i)["x"]) for i, k in enumerate(keys))


def test_a_failed_background_write_is_raised_by_flush(tmp_path: Path) -> None:
    (tmp_path / "latents").write_text("a file where the cache folder should be")
    store = DiskStore(tmp_path, "latents")
    store.put(K(1), entry(1), {})
    with pytest.raises(EnvironmentProblem, match="cache.dir"):
        store.flush()
