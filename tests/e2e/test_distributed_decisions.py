"""Decisions every process of a multi-process run must take alike (two gloo processes on the
CPU, tiny flavor): what one process measures or loses must never leave the others waiting in
a collective it no longer enters. The sharded (FSDP) keep_best run is test_fsdp.py's fixture.

Tiers: the validation decisions (early stopping from rank 0's loss, validation off after one
process's failure) run by default in one launch; the metrics process dying on rank 0 is
`full_only` (the same death is shown in one process by tests/unit/test_sample_metrics.py, and
nothing there is collective). A stop signal to one process of a sharded run: test_fsdp.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from .conftest import run_toml
from .test_distributed import ROOT, held_out, kill_tree, launch


def test_every_process_takes_the_same_validation_decisions(tmp_path: Path, images: Path) -> None:
    """Rank 1 measures a worse validation loss each time (diverging_rank.py), rank 0 a better
    one: with early_stop_patience 1 rank 1 alone would stop after step 2 while rank 0 trains
    on; every process decides from rank 0's loss, so none stops. Rank 1's third evaluation
    fails: validation is off on both from then on (as in one process), and the run ends whole."""
    cfg = run_toml(tmp_path, images, steps=4, extra=held_out(tmp_path, images)
                   + "every_n_steps = 1\nearly_stop_patience = 1\n")
    done = launch([str(ROOT / "tests" / "e2e" / "diverging_rank.py"), "train", str(cfg),
                   "--no-progress", "--set", "train.batch_size=1"], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(r) for r in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("val_loss")) for r in rows] == [(1, 9.0), (2, 8.0), (3, None),
                                                               (4, None)]
    assert "early stop" not in done.stderr
    assert ("[rank 0] WARNING: validation failed and is now off (training goes on): RuntimeError: "
            "rank one could not evaluate (injected by the test) (rank 1)") in done.stderr
    assert (tmp_path / "out" / "lora.safetensors").is_file()


def metrics_child(launcher: int) -> int | None:
    """The pid of the metrics process under `launcher` (forked by its fork server, so its
    parent runs the fork server too), None before rank 0 started it."""
    import psutil

    def forkserver(proc: psutil.Process) -> bool:
        return "multiprocessing.forkserver" in " ".join(proc.cmdline())

    for proc in psutil.Process(launcher).children(recursive=True):
        try:
            if forkserver(proc) and forkserver(proc.parent()):
                return proc.pid
        except psutil.NoSuchProcess:
            continue
    return None


@pytest.mark.full_only
def test_the_metrics_process_dying_on_rank_0_stops_no_process(
        tmp_path: Path, images: Path, scorer_models: tuple) -> None:
    """Sample metrics choose the best step (save.keep_best = fidelity) in a data-parallel run;
    the prompt file changes after step 0's event (rank 0 alone reads it and encodes the new
    text) and rank 0's metrics process is killed once it measured step 0: every process trains
    to the end, the next event is logged as lost, and the best is chosen among the measured
    steps."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 2\n")
    cfg = run_toml(tmp_path, images, steps=8, prompts=prompts,
                   extra=f'\n[metrics]\nenabled = true\ndino = "{scorer_models[0].as_posix()}"\n')
    cmd = [sys.executable, "-m", "difftune", "train", str(cfg), "--no-progress", "--num-processes",
           "2", "--set", "train.batch_size=1", "--set", "save.keep_best=fidelity"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "out" / "metrics.jsonl", time.monotonic() + 180

    def wait(done: Callable[[], bool]) -> None:
        while not done():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)

    try:  # step 0's image written: the next events (2 steps on) read the new text
        wait(lambda: bool(list((tmp_path / "out" / "samples").glob("step-000000_*.png"))))
        prompts.write_text("a pink ring --w 32 --h 32 --s 2\n")  # re-read by rank 0 alone
        wait(lambda: metrics.exists() and '"event": "samples"' in metrics.read_text())
        child = metrics_child(proc.pid)  # step 0 measured; 2 to 8 wait for it
        assert child is not None
        os.kill(child, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    measured = {r["step"] for r in rows if r.get("event") == "samples"}
    assert "the metrics process died" in err
    record = json.loads((tmp_path / "out" / "best.json").read_text())
    assert record["best_step"] in measured and set(map(int, record["scores"])) == measured
    assert (tmp_path / "out" / "lora-best.safetensors").is_file()
    assert list((tmp_path / "out" / "samples").glob("step-000008_*pink*.png"))  # the new text
