"""Heartbeats between the processes of a multi-process run, so that a lost node is named.

A node that dies (power, network, the kernel's OOM killer, `kill -9`) leaves the others in a
collective: on the loopback or a LAN that closes the connection and the collective fails at
once, but a dead network can hold it until the backend's timeout (an hour here, see dist.py).
Each process therefore runs a thread that counts a heartbeat in a small TCPStore that rank 0
hosts, once a second, and reads the others' counts. A process whose count has not moved for
`DIFFTUNE_PEER_TIMEOUT` seconds (default 60) and that did not say it was leaving is lost: the
thread names it (rank, node), says where the last checkpoint is and how to resume, and ends
this process with exit code 1 (the launcher then stops the rest of its node). A process that
ends for a reason of its own (an error it reports, the end of the run) marks itself as leaving
first, so the others report "another process failed" rather than a lost node.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

from difftune.train.dist import Dist
from difftune.train.nodes import Layout

INTERVAL = 1.0  # seconds between heartbeats


def timeout() -> float:
    """Seconds without a heartbeat after which a process counts as lost."""
    return float(os.environ.get("DIFFTUNE_PEER_TIMEOUT", "60"))


class Watch:
    """This process's heartbeat thread and its view of the others'."""

    def __init__(self, store: torch.distributed.Store, dist: Dist, layout: Layout,
                 checkpoints: Path) -> None:
        self.store, self.dist, self.layout, self.checkpoints = store, dist, layout, checkpoints
        self.limit = timeout()
        self._stop = threading.Event()
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in range(dist.world) if r != dist.rank}
        self._store_failed: float | None = None
        self._thread = threading.Thread(target=self._run, name="difftune-heartbeat", daemon=True)

    def _run(self) -> None:
        """Beat, look, and end the process once another one is lost."""
        while not self._stop.wait(INTERVAL):
            lost = self._look()
            if lost and not self._stop.is_set():
                self._report(lost)
                os._exit(1)  # the main thread may be held in a collective that never returns

    def _look(self) -> list[int]:
        """Beat once; the ranks lost so far (none leaving of their own accord)."""
        now = time.monotonic()
        try:
            self.store.add(f"beat/{self.dist.rank}", 1)
            for rank, (count, since) in self._seen.items():
                if self.store.add(f"gone/{rank}", 0):
                    self._seen[rank] = (-2, now)  # left: never lost
                    continue
                beats = self.store.add(f"beat/{rank}", 0)
                if beats != count and count != -2:
                    self._seen[rank] = (beats, now)
            self._store_failed = None
        except (RuntimeError, OSError):  # rank 0, which holds the store, is gone
            self._store_failed = self._store_failed or now
            left = self._seen.get(0, (0, now))[0] == -2  # it said so before it went
            return [0] if now - self._store_failed > self.limit and not left else []
        return [r for r, (count, since) in self._seen.items()
                if count != -2 and now - since > self.limit]

    def _report(self, lost: list[int]) -> None:
        """The message of a lost node, on stderr (every process that sees it says it)."""
        from difftune.train.checkpoint.files import complete_checkpoints

        who = ", ".join(f"rank {r} (node {self.layout.node_of(r)})" for r in lost)
        done = complete_checkpoints(self.checkpoints) if self.checkpoints.is_dir() else []
        kept = (f"the last checkpoint is intact: {done[-1]}" if done
                else "no checkpoint was saved yet")
        print(f"[rank {self.dist.rank}] stopped: lost {who}: no heartbeat for "
              f"{self.limit:g} s (its process or node is gone); {kept}\n{hint}",
              file=sys.stderr, flush=True)

    def settle(self) -> None:
        """After a collective failed: wait until every other process has said it is leaving,
        or until the thread names a lost one (it then ends the process), at most the timeout
        and a little more."""
        deadline = time.monotonic() + self.limit + 3 * INTERVAL
        while time.monotonic() < deadline and self._thread.is_alive():
            if all(count == -2 for count, _ in self._seen.values()):
                return
            time.sleep(INTERVAL / 4)

    def leave(self) -> None:
        """Say this process is leaving of its own accord, and stop beating. Rank 0, whose
        process holds the store, keeps it up a moment (at most three heartbeats) until the
        others have read that, or have left too."""
        self._stop.set()
        try:
            self.store.add(f"gone/{self.dist.rank}", 1)
            deadline = time.monotonic() + 3 * INTERVAL
            while self.dist.main and time.monotonic() < deadline and not all(
                    self.store.add(f"gone/{r}", 0) for r in self._seen):
                time.sleep(INTERVAL / 10)
        except (RuntimeError, OSError):
            pass  # the store's host left first: nobody is left to tell


_active: Watch | None = None
hint = ""  # how to resume this run (the CLI sets it before training starts)


def start(dist: Dist, checkpoints: Path) -> Watch | None:
    """Start this process's heartbeat (collective: every process of a multi-process run calls
    it once); None for a single process."""
    global _active
    if dist.world == 1 or _active is not None:
        return _active
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    wait = timedelta(seconds=timeout())
    if dist.main:
        store = torch.distributed.TCPStore(host, 0, dist.world, True, wait,
                                           wait_for_workers=False)
        dist.broadcast(store.port)
    else:
        store = torch.distributed.TCPStore(host, dist.broadcast(None), dist.world, False, wait)
    _active = Watch(store, dist, Layout.from_env(), checkpoints)
    _active._thread.start()
    return _active


def active() -> Watch | None:
    """This process's watch, if it runs one."""
    return _active


def leave() -> None:
    """Mark this process as leaving (no-op without a watch); called as the CLI returns."""
    if _active is not None:
        _active.leave()
