"""Where the processes of a multi-node run sit, and whether they see the same folders.

Rank 0 writes the run folder and its checkpoints once, FSDP checkpoints are written by every
process into one folder, every process reads the checkpoint it resumes from, and the disk
caches are filled once for the whole run (each entry by exactly one process: its share by
global rank, see train/setup.fill_caches) and read by all. So every node must see the same
`save.dir` and `cache.dir`: shared storage (NFS, Lustre, a cloud file system). This is checked
before anything is written, by a token file rank 0 writes and every process looks for.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from pathlib import Path

from difftune.errors import EnvironmentProblem
from difftune.train.dist import Dist
from difftune.train.nodes import Layout

log = logging.getLogger("difftune")


def log_layout(dist: Dist, layout: Layout) -> None:
    """Log (rank 0) each node's host and global ranks, as the processes report them
    (collective)."""
    seen = dist.gather((os.environ.get("GROUP_RANK", "0"), socket.gethostname(), dist.rank,
                        os.environ.get("LOCAL_RANK", "0")))
    if not dist.main:
        return
    nodes: dict[str, list[str]] = {}
    hosts: dict[str, str] = {}
    for node, host, rank, local in seen:
        nodes.setdefault(node, []).append(f"{rank} (local {local})")
        hosts[node] = host
    log.info("%d node(s) x %d process(es): %s", layout.nodes, layout.per_node, "; ".join(
        f"node {n} on {hosts[n]}: ranks {', '.join(r)}" for n, r in sorted(nodes.items())))


def require_shared(dist: Dist, layout: Layout, folders: dict[str, Path]) -> None:
    """Refuse a multi-node run whose `folders` (config field -> path) some node cannot see
    (collective; every process raises the same error)."""
    if layout.nodes == 1:
        return
    token = dist.broadcast(secrets.token_hex(8) if dist.main else None)
    marks = {field: folder / f".difftune-shared-{token}" for field, folder in folders.items()}
    if dist.main:
        for mark in marks.values():
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.write_text("written by rank 0 to see whether every node sees this folder\n")
    dist.barrier()
    blind = dist.gather([field for field, mark in marks.items() if not mark.exists()])
    dist.barrier()
    if dist.main:
        for mark in marks.values():
            mark.unlink(missing_ok=True)
    problems = [f"{field} = {folders[field]} (not seen by rank {rank} on node "
                f"{layout.node_of(rank)})" for rank, fields in enumerate(blind)
                for field in fields]
    if problems:
        raise EnvironmentProblem(
            "a multi-node run needs its folders on storage every node sees (NFS, Lustre, a "
            f"cloud file system): {'; '.join(problems)}; put them on shared storage")
