"""`difftune train --num-processes N`: the same run under `accelerate launch`, N processes.

The command line is handed to accelerate's launcher unchanged except for `--num-processes`,
so `difftune train run.toml --num-processes 4` is `accelerate launch --multi_gpu
--num_processes 4 -m difftune train run.toml`. Several machines need accelerate's own config
(`accelerate config`, then `accelerate launch -m difftune train ...` on each machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from difftune.errors import EnvironmentProblem


def without_num_processes(argv: list[str]) -> list[str]:
    """`argv` less its `--num-processes N` / `--num-processes=N` option."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--num-processes":
            skip = True
        elif not arg.startswith("--num-processes="):
            out.append(arg)
    return out


def command(n: int, argv: list[str]) -> list[str]:
    """The accelerate launch command line for `n` processes on this machine."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(n), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", "0",  # 0: a free port
            "-m", "difftune", *without_num_processes(argv)]


def check_devices(n: int) -> None:
    """One GPU per process: refuse more processes than visible GPUs (CPU runs are for tests
    and small trials, and share the cores)."""
    gpus = torch.cuda.device_count()
    if gpus and n > gpus:
        raise EnvironmentProblem(f"--num-processes {n} but {gpus} GPU(s) are visible; use at "
                                 f"most {gpus} (one process per GPU)")


def launch(n: int, argv: list[str]) -> int:
    """Run the command under accelerate launch and return its exit code.

    Ctrl-C reaches every process of the terminal's group: the training processes agree on
    the step to stop after and rank 0 saves a checkpoint; this parent only waits for them.
    """
    check_devices(n)
    child = subprocess.Popen(command(n, argv))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (a scheduler, the web app's Stop) reaches this process alone: passed on to every
    # training process, as Ctrl-C reaches them all.
    before = signal.signal(signal.SIGTERM, lambda signum, frame: stop_workers(child))
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, before)


def stop_workers(child: subprocess.Popen) -> None:
    """SIGTERM to each training process (the launcher's children, read from /proc), so that
    they agree on the step to stop after, save a checkpoint and exit 0, and the launcher with
    them. The launcher itself would end them with SIGKILL 30 s after a signal of its own (and
    exit 1 with a traceback), so it gets the signal only while it has no children yet (or
    where /proc does not list them)."""
    try:
        listed = Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text()
        workers = [int(pid) for pid in listed.split()]
    except (OSError, ValueError):
        workers = []
    for pid in workers or [child.pid]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
