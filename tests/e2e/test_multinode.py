"""Several machines, tested as two "nodes" on this one: two torchrun node groups on the loopback
address (each `--nnodes=2 --nproc-per-node=1`, one process, gloo), meeting through torchrun's
c10d rendezvous (node 0's group hosts its store), through the real CLI on the tiny flavor.

The 2-node run with train.batch_size 1 must equal the one-process run with batch 2 (the
session's `finished` run) to the tolerance of test_distributed.py; node 1 hanging and then
killed (agent and process, as a lost machine) must stop node 0 within the heartbeat timeout
with a message naming rank 1, its last checkpoint intact, and the resume line; that checkpoint
resumed with another global batch must be refused before anything is written, and resumed
on one node with the same global batch must end where the uninterrupted 2-node run ended; a run folder one node
cannot see (node 1 in its own mount namespace) must be refused before anything is written.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from difftune.cache.disk import DiskStore
from difftune.cli import main
from difftune.train.checkpoint.files import complete_checkpoints

from .conftest import copy_run, run_toml
from .test_distributed import ROOT, assert_close_runs, losses

SETS = ["--no-progress", "--set", "train.batch_size=1", "--set", "save.every_n_steps=2"]
TIMEOUT = 8  # DIFFTUNE_PEER_TIMEOUT of these runs, seconds


def free_port() -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(program: list[str], env: dict[str, str] | None = None,
                prefix: tuple[list[str], list[str]] = ([], [])) -> list[subprocess.Popen]:
    """Two torchrun node groups running `program` (`-m difftune ...` or a script and its
    arguments), each command after its `prefix`; node 0 hosts the rendezvous store. Their
    output goes to pipes."""
    port, run_id = free_port(), f"t{os.getpid()}{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DIFFTUNE_PEER_TIMEOUT": str(TIMEOUT),
           **(env or {})}
    return [subprocess.Popen(
        [*prefix[node], sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
         "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={1 - node}", *program], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """The 4-step run on two nodes of one process each, disk caches; its run file."""
    cfg = run_toml(tmp_path_factory.mktemp("nodes"), images)
    nodes = start_nodes(["-m", "difftune", "train", str(cfg), *SETS,
                         "--set", 'cache.latents="disk"', "--set", 'cache.text="disk"'])
    for node in nodes:
        out, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]
    return cfg


def test_two_nodes_match_one_process_with_the_same_global_batch(two_nodes: Path,
                                                                finished: Path) -> None:
    assert_close_runs(two_nodes.parent / "out", finished.parent / "out")


def test_two_nodes_fill_each_cache_entry_once_and_write_the_run_once(two_nodes: Path) -> None:
    out = two_nodes.parent / "out"
    assert len(DiskStore(out / "cache", "latents")) == 6
    assert len(DiskStore(out / "cache", "text")) == 12
    assert [p for p in out.rglob("*") if ".tmp" in p.name or ".difftune-shared" in p.name] == []
    log = (out / "difftune.log").read_text()
    assert log.count("loading flux model") == 1
    assert "2 node(s) x 1 process(es): node 0 on " in log
    assert "node 1 on " in log and "ranks 1 (local 0)" in log
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002",
                                                                       "step-000004"]


def test_check_prints_the_layout_and_the_global_batch(finished: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      tmp_path: Path) -> None:
    cfg = copy_run(finished, tmp_path)
    assert main(["check", str(cfg), "--nodes", "0"]) == 2
    assert "--nodes and --processes-per-node" in capsys.readouterr().err
    sets = ["--set", f'save.dir="{(tmp_path / "new").as_posix()}"', "--set", "train.batch_size=1"]
    assert main(["check", str(cfg), "--nodes", "2", "--processes-per-node", "2", *sets]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 2 process(es) = 4 processes (node 0: ranks 0-1, node 1: ranks 2-3" in out
    assert "train.batch_size 1 x 4 processes x train.grad_accum 1 = 4 images" in out
    assert "train.lr 0.01 per optimizer step, not scaled" in out
    assert "torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d" in out


def test_a_lost_node_is_named_and_the_run_resumes_on_one_node(two_nodes: Path,
                                                             tmp_path: Path) -> None:
    cfg = copy_run(two_nodes, tmp_path / "lost")
    (tmp_path / "lost" / "out").rename(tmp_path / "uninterrupted")
    hung = tmp_path / "hung.pid"
    nodes = start_nodes([str(ROOT / "tests" / "e2e" / "hanging_rank.py"), "train", str(cfg),
                         *SETS], {"DIFFTUNE_TEST_HUNG_FILE": str(hung)})
    deadline = time.monotonic() + 180
    while not hung.exists():
        assert time.monotonic() < deadline and nodes[0].poll() is None
        time.sleep(0.1)
    agent = psutil.Process(nodes[1].pid)
    for proc in [agent, *agent.children(recursive=True)]:  # node 1 is lost: all of it at once
        proc.kill()
    killed = time.monotonic()
    out, err = nodes[0].communicate(timeout=120)
    nodes[1].communicate()
    assert nodes[0].returncode != 0
    assert time.monotonic() - killed < TIMEOUT + 20  # stopped, not held in the all-reduce
    saved = tmp_path / "lost" / "out" / "checkpoints" / "step-000002"
    assert f"[rank 0] stopped: lost rank 1 (node 1): no heartbeat for {TIMEOUT} s" in err
    assert f"the last checkpoint is intact: {saved}" in err
    assert "resume with: torchrun --nnodes=2 --nproc-per-node=1" in err
    assert "--resume latest (on every node" in err
    assert complete_checkpoints(saved.parent) == [saved]
    # Resumed with another global batch (1, where the run's was 2): refused, nothing written.
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "lost" / "out").rglob("*")}
    assert main(["train", str(cfg), "--no-progress", "--set", "train.batch_size=1",
                 "--resume", "latest"]) == 2
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "lost" / "out").rglob("*")} == files
    # Resumed on one node (one process, batch 2: the same global batch): the run's end.
    assert main(["train", str(cfg), "--no-progress", "--set", "train.batch_size=2",
                 "--resume", "latest"]) == 0
    assert_close_runs(tmp_path / "lost" / "out", tmp_path / "uninterrupted")
    assert len(losses(tmp_path / "lost" / "out")) == 4


def test_a_run_folder_one_node_cannot_see_is_refused(tmp_path: Path, images: Path) -> None:
    """Node 1 runs in its own mount namespace where an empty tmpfs hides the folder holding
    save.dir: storage that is not shared."""
    hidden = tmp_path / "shared"
    (hidden / "out").mkdir(parents=True)
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("mount namespaces (unshare -rm) are not available here")
    cfg = run_toml(tmp_path, images)
    cfg.write_text(cfg.read_text().replace(str(tmp_path / "out"), str(hidden / "out")))
    mask = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs none "{hidden}" && exec "$@"', "sh"]
    nodes = start_nodes(["-m", "difftune", "train", str(cfg), *SETS], prefix=([], mask))
    errs = [node.communicate(timeout=240)[1] for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    assert (f"[rank 0] error: a multi-node run needs its folders on storage every node sees "
            f"(NFS, Lustre, a cloud file system): save.dir = {hidden / 'out'} (not seen by "
            "rank 1 on node 1); put them on shared storage") in errs[0]
    assert list((hidden / "out").iterdir()) == []  # refused before anything was written
