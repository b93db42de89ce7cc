"""`difftune train --num-processes N`: the same run under `accelerate launch`, N processes.

The command line is handed to accelerate's launcher unchanged except for `--num-processes`,
so `difftune train run.toml --num-processes 4` is `accelerate launch --multi_gpu
--num_processes 4 -m difftune train run.toml`. Several machines need accelerate's own config
(`accelerate config`, then `accelerate launch -m difftune train ...` on each machine).
"""

from __future__ import annotations

import signal
import subprocess
import sys

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
    try:
        return child.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
