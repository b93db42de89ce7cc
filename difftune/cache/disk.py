"""On-disk, content-addressed cache store: one safetensors file per entry.

Entries live at `root/kind/<key[:2]>/<key>.safetensors`. Each file carries its own key and a
CRC32 of its data section in the safetensors metadata, so a truncated, garbled or misplaced file
is recognised on read, deleted and reported as a miss (the caller recomputes it). Writes go to a
`.tmp-*` file in the same folder and are renamed into place, so concurrent writers of the same key
and processes killed mid-write never leave a half-written entry under a real name.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import time
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch

from difftune.files.space import check_free, no_room

_SUFFIX = ".safetensors"
_TMP = ".tmp-"
_KEY = re.compile(r"[0-9a-f]{2,}")
_STALE_TMP_S = 3600.0
_MAX_QUEUED = 64  # entries waiting for the writer thread at most
_HEADER_BYTES = 1024  # a safetensors header with difftune's metadata, about
_FIX = "free space there, or set cache.dir to a folder with room"
# What a checked read learned about an entry: (file size, data start, data CRC, tensor infos).
_Layout = tuple[int, int, int, tuple[tuple[str, dict], ...]]
_DTYPES: dict[str, torch.dtype] = {  # safetensors dtype names -> torch dtypes
    n: getattr(torch, a) for n, a in (x.split(":") for x in (
        "F64:float64 F32:float32 F16:float16 BF16:bfloat16 I64:int64 I32:int32 I16:int16 "
        "I8:int8 U8:uint8 U16:uint16 U32:uint32 U64:uint64 BOOL:bool F8_E4M3:float8_e4m3fn "
        "F8_E5M2:float8_e5m2").split()) if hasattr(torch, a)}


def _check(head: bytes, key: str, size: int) -> dict:
    """Parse a JSON header and check it against `key` and the file size; raises if invalid."""
    header = json.loads(head)
    if (header.get("__metadata__") or {}).get("difftune.key") != key:
        raise ValueError("entry key mismatch")
    need = 0
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end or end - begin != (
                    math.prod(info["shape"]) * _DTYPES[info["dtype"]].itemsize):
                raise ValueError(f"bad offsets for {name}")
            need = max(need, end)
    if size != 8 + len(head) + need:
        raise ValueError("data length does not match header")
    return header


def _tensor(buf: bytearray, start: int, info: dict) -> torch.Tensor:
    """A tensor over `buf` (no copy) at its offsets; copied only when misaligned for its dtype."""
    dt, shape, (begin, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
    if begin == end:
        return torch.empty(shape, dtype=dt)
    if (start + begin) % dt.itemsize:
        return torch.frombuffer(buf[start + begin:start + end], dtype=dt).view(shape)
    return torch.frombuffer(buf, dtype=dt, count=(end - begin) // dt.itemsize,
                            offset=start + begin).view(shape)


def _read(path: str) -> tuple[bytearray, int, int]:
    """A whole file in one buffer: (buffer, bytes read, size when opened); plain os calls, fast."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        got = os.readv(fd, [buf]) if size else 0
        while 0 < got < size:  # short reads are rare; finish them
            chunk = os.read(fd, size - got)
            if not chunk:
                break
            buf[got:got + len(chunk)] = chunk
            got += len(chunk)
    finally:
        os.close(fd)
    return buf, got, size


class DiskStore:
    """A `Store` keeping each entry in its own safetensors file under `root/kind`."""

    def __init__(self, root: Path, kind: str) -> None:
        self.dir = Path(root) / kind
        self.bad: list[Path] = []
        self._where: dict[str, str] = {}
        self._layouts: dict[str, _Layout] = {}
        self._made: set[Path] = set()
        self._pending: dict[str, dict[str, torch.Tensor]] = {}  # queued, not yet on disk
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future] = []
        self._expected = 0  # entries the current fill will write (from `missing`)
        self._entry_bytes = 0  # size of the last entry put

    def path(self, key: str) -> Path:
        """Where the entry for `key` lives (keys are lowercase hex, so they cannot escape)."""
        if not _KEY.fullmatch(key):
            raise ValueError(f"cache key must be lowercase hex, got {key!r}")
        return self.dir / key[:2] / f"{key}{_SUFFIX}"

    def _drop(self, path: Path) -> None:
        """Delete a bad entry and remember it for `report`."""
        with contextlib.suppress(OSError):
            path.unlink()
        self.bad.append(path)

    def _head(self, path: Path, key: str) -> dict | None:
        """Metadata of a complete, well-formed file, read without its data; None when absent.
        Raises ValueError when the file exists but is bad. No side effects."""
        try:
            with open(path, "rb", buffering=0) as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(0)
                n = int.from_bytes(f.read(8), "little")
                if n == 0 or 8 + n > size:
                    raise ValueError("truncated header")
                return _check(f.read(n), key, size)["__metadata__"]
        except FileNotFoundError:
            return None
        except (OSError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(str(e)) from e

    def get(self, key: str) -> dict[str, torch.Tensor] | None:
        """The entry's tensors (on CPU), or None when absent or bad (a bad file is deleted)."""
        queued = self._pending.get(key)
        if queued is not None:
            return queued
        path = self._where.get(key) or self._remember(key)
        try:
            buf, got, size = _read(path)
        except FileNotFoundError:
            return None
        except OSError:
            self._drop(Path(path))
            return None
        view = memoryview(buf)
        known = self._layouts.get(key)
        try:
            if known is None or known[0] != size or zlib.crc32(view[known[1]:]) != known[2]:
                known = self._layout(buf, got, size, key)  # first read, or the file changed
            start = known[1]
            return {name: _tensor(buf, start, info) for name, info in known[3]}
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError):
            self._layouts.pop(key, None)
            self._drop(Path(path))
            return None

    def _layout(self, buf: bytearray, got: int, size: int, key: str) -> _Layout:
        """Parse and check a whole file's header and data CRC; remembers the result.

        A later read of the same key with the same size and data CRC skips the header parse
        (JSON is most of a small entry's read time); its data is still checked every time.
        """
        n = int.from_bytes(buf[:8], "little")
        if got != size or size < 8 or n == 0 or 8 + n > size:
            raise ValueError("truncated header")
        header, start = _check(bytes(buf[8:8 + n]), key, size), 8 + n
        crc = zlib.crc32(memoryview(buf)[start:])
        if str(crc) != header["__metadata__"].get("difftune.crc32"):
            raise ValueError("crc mismatch")
        tensors = tuple((k, v) for k, v in header.items() if k != "__metadata__")
        self._layouts[key] = layout = (size, start, crc, tensors)
        return layout

    def _remember(self, key: str) -> str:
        """The entry's path as a string, kept: reads come every epoch, paths cost to build."""
        self._where[key] = where = str(self.path(key))
        return where

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Queue the entry for writing by a background thread; readable at once.

        The file I/O overlaps the next item's encoding (writing is a third of a small
        model's fill otherwise). `flush` waits for the queue and raises a failed write.
        """
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        self._entry_bytes = sum(v.nbytes for v in cpu.values()) + _HEADER_BYTES
        if self._expected:  # the first entry of a fill: is there room for all of them?
            check_free(self.dir, f"{self._expected} cache entries",
                       self._expected * self._entry_bytes, _FIX)
            self._expected = 0
        with self._lock:
            self._pending[key] = cpu
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="difftune-cache")
        self._futures.append(self._pool.submit(self._write_pending, key, cpu, meta))
        if len(self._futures) > _MAX_QUEUED:  # bound the memory held by queued entries
            self._wait(self._futures.pop(0))

    def _write_pending(self, key: str, cpu: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        try:
            self.write(key, cpu, meta)
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def flush(self) -> None:
        """Wait until every queued entry is on disk; a failed write raises `EnvironmentProblem`."""
        futures, self._futures = self._futures, []
        for future in futures:
            self._wait(future)

    def _wait(self, future: Future) -> None:
        """A queued write's outcome: a failed one (a full disk) as `EnvironmentProblem`
        naming the folder, the space free and the space the queued entries need."""
        try:
            future.result()
        except OSError as err:
            for queued in self._futures:  # nothing more is written after a failure
                queued.cancel()
            need = (len(self._futures) + 1) * self._entry_bytes
            raise no_room(self.dir, "the cache", need, _FIX, err.strerror or str(err)) from err

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
        """Write the entry now, atomically (temp file, then rename); skip if a valid one exists."""
        path = self.path(key)
        try:  # another process may have finished it meanwhile (a stat first: misses are cheap)
            if os.path.exists(path) and self._head(path, key) is not None:
                return
        except ValueError:
            pass  # overwritten below
        cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        md = {**meta, "difftune.key": key}
        blob = safetensors.torch.save(cpu, md)
        n = int.from_bytes(blob[:8], "little")
        md["difftune.crc32"] = str(zlib.crc32(memoryview(blob)[8 + n:]))
        blob = safetensors.torch.save(cpu, md)  # same data section, header now has the crc
        tmp = path.parent / f"{_TMP}{os.getpid()}-{secrets.token_hex(6)}"
        if path.parent not in self._made:  # one mkdir per shard, not one per entry
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
        try:
            f = open(tmp, "xb")
        except FileNotFoundError:  # a concurrent prune removed the empty shard folder
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "xb")
        try:
            with f:
                f.write(blob)
            # No fsync: a killed process leaves its data in the page cache, and what a power
            # loss could garble (a renamed file whose data never reached the disk) fails the
            # CRC on read and is recomputed. Syncing every entry would slow filling by ~2x.
            os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def __contains__(self, key: str) -> bool:
        """True if a complete entry with the right key exists (header only; bad files dropped)."""
        if key in self._pending:
            return True
        path = self.path(key)
        try:
            return self._head(path, key) is not None
        except ValueError:
            self._drop(path)
            return False

    def missing(self, keys: list[str]) -> set[str]:
        """The keys with no valid entry: one folder listing, then a header check of the present.

        A cold cache costs no per-key system call; a warm one checks each header (truncated
        files are found, dropped and reported here, before training).
        """
        with self._lock:  # pending first: a write that lands after this is on the listing
            queued = set(self._pending)
        present = queued | set(self.keys())
        out = {k for k in keys if k not in present or k not in self}
        self._expected = len(out)  # a fill computes these next: its first put checks the room
        return out

    def meta(self, key: str) -> dict[str, str] | None:
        """The stored metadata of an entry (its inputs plus key and crc), or None."""
        try:
            return self._head(self.path(key), key)
        except ValueError:
            return None

    def _files(self) -> Iterator[os.DirEntry]:
        """Every file in every shard folder (entries and temp files)."""
        try:
            shards = [d for d in os.scandir(self.dir) if d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for shard in shards:
            try:
                yield from (e for e in os.scandir(shard.path) if e.is_file(follow_symlinks=False))
            except FileNotFoundError:
                continue

    def keys(self) -> Iterator[str]:
        """Keys of all stored entries (temp files of unfinished writes are ignored)."""
        for e in self._files():
            if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                yield e.name[: -len(_SUFFIX)]

    def __len__(self) -> int:
        self.flush()
        return sum(1 for _ in self.keys())

    def prune(self, keep: set[str]) -> tuple[int, int]:
        """Delete entries not in `keep` and temp files over an hour old; (files, bytes) freed."""
        self.flush()
        count = freed = 0
        cutoff = time.time() - _STALE_TMP_S
        for e in list(self._files()):
            try:
                st = e.stat(follow_symlinks=False)
                if e.name.startswith(_TMP):
                    if st.st_mtime >= cutoff:
                        continue
                elif not e.name.endswith(_SUFFIX) or e.name[: -len(_SUFFIX)] in keep:
                    continue
                os.unlink(e.path)
            except FileNotFoundError:
                continue
            count, freed = count + 1, freed + st.st_size
        with contextlib.suppress(FileNotFoundError):
            for shard in list(os.scandir(self.dir)):
                with contextlib.suppress(OSError):
                    os.rmdir(shard.path)  # only succeeds when empty
        return count, freed

    def report(self) -> str | None:
        """One summary of the bad entries dropped since the last call (then forgotten), or None."""
        if not self.bad:
            return None
        n, first = len(self.bad), self.bad[0]
        self.bad = []
        what, verb = ("entry", "was") if n == 1 else ("entries", "were")
        return (f"{n} corrupt or truncated cache {what} under {self.dir} {verb} discarded and "
                f"recomputed (first: {first})")
