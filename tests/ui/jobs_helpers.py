"""Shared pieces of the job tests: a root with run files, a queue whose jobs run small Python
scripts (the job's first argument) instead of the CLI, and waiting for a state."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from difftune.ui.jobs.queue import JobQueue
from difftune.ui.jobs.launch import is_alive
from difftune.ui.jobs.store import Job
from difftune.ui.security import Roots

# A job that prints "ready" and sleeps (the default SIGTERM action ends it).
SLEEP = "import time; print('ready', flush=True); time.sleep(60)"
# A job that behaves like `difftune train` on SIGTERM: finishes its step, says so, exits 0.
TRAINLIKE = """
import signal, sys, time
asked = []
signal.signal(signal.SIGTERM, lambda s, f: asked.append(s))
print('ready', flush=True)
for step in range(1200):
    if asked:
        print(f'stopped after step {step}; checkpoint saved to ckpt/step-{step:06d}')
        sys.exit(0)
    time.sleep(0.05)
"""
# What the CLI prints for a bad field, and its exit code.
CLI_ERROR = ("error: run.toml: 1 problem(s) in the configuration:\n"
             "  - train.lr: Input should be greater than 0 (got -1.0)")
FAIL = f"import sys; print('loading'); print({CLI_ERROR!r}, file=sys.stderr); sys.exit(2)"
QUICK = "print('done')"


def script_command(job: Job) -> list[str]:
    """Run the job's first argument as a Python script (what a test job does)."""
    return [sys.executable, "-c", job.args[0]]


def make_root(tmp_path: Path) -> Path:
    """A root with run files a.toml, b.toml, c.toml (run folders runs/a, runs/b, runs/c)."""
    root = tmp_path / "root"
    root.mkdir()
    for name in "abc":
        (root / f"{name}.toml").write_text(f'[save]\ndir = "runs/{name}"\n')
    (tmp_path / "outside").mkdir()
    return root


def make_queue(root: Path, gpus: bool | None = None) -> JobQueue:
    """A queue over `root` (database in `root/.difftune-ui`) running scripts as jobs; `gpus`
    as JobQueue takes it (whether "default" and "cuda:N" are GPUs, or all the CPU)."""
    return JobQueue(root / ".difftune-ui" / "jobs.sqlite", Roots.of([root]),
                    command=script_command, gpus=gpus)


def wait_for(queue: JobQueue, job_id: int, states: tuple[str, ...], timeout: float = 15) -> Job:
    """Tick `queue` until job `job_id` is in one of `states`; fail after `timeout` seconds."""
    end = time.monotonic() + timeout
    while True:
        queue.tick()
        job = queue.get(job_id)
        if job.state in states:
            return job
        assert time.monotonic() < end, f"job {job_id} still {job.state}, wanted {states}"
        time.sleep(0.05)


def wait_log(queue: JobQueue, job_id: int, text: str, timeout: float = 15) -> None:
    """Wait until the job's log has the line `text` (the script is ready for a signal)."""
    end = time.monotonic() + timeout
    while text not in queue.tail(job_id):
        assert time.monotonic() < end, f"job {job_id}'s log never showed {text!r}"
        time.sleep(0.05)


def kill_jobs(root: Path) -> None:
    """Kill what the jobs under `root` left running (a test's clean-up): each wrapper leads
    its own process group, the CLI (here the script) in it."""
    for pidfile in root.rglob(".difftune-jobs/*.pid.json"):
        info = json.loads(pidfile.read_text())
        if is_alive(info["pid"], info["start"]):
            try:
                os.killpg(info["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_outputs(run_dir: Path, step: int, total: int, final: bool,
                samples: tuple[int, ...] = ()) -> None:
    """Write what a training of `total` steps leaves in `run_dir` at `step`: its resolved
    config, metrics rows (loss 1/step, 2 it/s), a complete checkpoint, two sample images
    (prompts 0 and 1) at each step of `samples`, and (`final`) the final LoRA file."""
    from PIL import Image

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.json").write_text(json.dumps(
        {"train": {"steps": total}, "save": {"name": "lora"}}))
    (run_dir / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "loss": 1 / s, "it_per_s": 2.0}) + "\n"
        for s in range(1, step + 1)))
    (run_dir / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    (run_dir / "checkpoints" / f"step-{step:06d}" / "state.json").write_text("{}")
    (run_dir / "samples").mkdir(exist_ok=True)
    for at in samples:
        for index, colour in enumerate(("red", "blue")):
            Image.new("RGB", (16, 16), colour).save(
                run_dir / "samples" / f"step-{at:06d}_{index:02d}_a-{colour}-square.png")
    if final:
        (run_dir / "lora.safetensors").write_bytes(b"{}")
