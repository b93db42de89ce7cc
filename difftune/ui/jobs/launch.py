"""How a job runs: a small wrapper process around the difftune CLI.

`python -m difftune.ui.jobs.launch --record FILE --log FILE -- <argv...>` starts `argv` (the
CLI) with its output appended to the log, passes SIGTERM/SIGINT on to it, waits, and writes
the exit record (exit code, time, the signal it passed on) atomically. The app starts the
wrapper in a new session, so neither closing the app nor Ctrl-C in its terminal stops a
job; and because the record is written by a process that outlives the app, a restarted app
finds how each job ended in the run folder. The app writes `<id>.pid.json` (the wrapper's
pid and its start time) as soon as the wrapper starts, so a pid reused later by another
process is never taken for the job.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from difftune.ui.jobs import cluster

# The verbs whose CLI has --no-progress (bars in a log file are noise).
NO_PROGRESS_VERBS = ("train", "check", "cache")
# What the wrapper passes on to the CLI.
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def cli_argv(verb: str, config: Path, args: list[str], python: str = sys.executable) -> list[str]:
    """The difftune CLI command a job of `verb` on `config` runs."""
    tail = ["--no-progress"] if verb in NO_PROGRESS_VERBS else []
    return [python, "-m", "difftune", verb, str(config), *args, *tail]


def device_env(device: str) -> dict[str, str]:
    """The environment changes that put a job on `device` ("default": as the app was started;
    "cpu": no GPU visible; "cuda:N": only GPU N visible, as cuda:0)."""
    device = parse_device(device)
    if device == "default" or cluster.is_slurm(device):
        return {}
    if device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {"CUDA_VISIBLE_DEVICES": device.removeprefix("cuda:")}


def parse_device(device: str) -> str:
    """`device` in its one spelling: "default", "cpu" or "cuda:N" with N as a plain number
    ("cuda:00" is "cuda:0"); ValueError for anything else."""
    if device in ("default", "cpu"):
        return device
    if cluster.is_slurm(device):
        return cluster.parse(device)
    found = re.fullmatch(r"cuda:([0-9]+)", device)
    if found is None:
        raise ValueError(f"device {device!r} is not one this app knows; use default, cpu or "
                         "cuda:N (N the GPU's index, as nvidia-smi lists it), or slurm:NxG"
                         "[@PARTITION] for the SLURM cluster")
    return f"cuda:{int(found.group(1))}"


def resolve_device(device: str, gpus: bool) -> str:
    """What `device` runs a job on: "cpu" or "cuda:N" (N as nvidia-smi numbers GPUs), so that
    two spellings of one device compare equal. `gpus`: whether the app sees a GPU; without
    one every job runs on the CPU. "default" is the first GPU the app's CUDA_VISIBLE_DEVICES
    leaves visible (GPU 0 when it is unset). ValueError for a device `parse_device` refuses."""
    device = parse_device(device)
    if cluster.is_slurm(device):
        return device
    if not gpus or device == "cpu":
        return "cpu"
    if device != "default":
        return device
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return f"cuda:{int(first)}" if first.isdigit() else f"cuda:{first}"  # a UUID stays one


@functools.cache
def gpus_visible() -> bool:
    """Whether torch sees a CUDA GPU from this process (asked once; torch is imported only
    here, when the first job is scheduled)."""
    import torch

    return bool(torch.cuda.is_available())


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as JSON atomically (temporary file, then rename): readers see all or
    nothing. The temporary file is created anew (a link left in its place is not followed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644),
                   "w", encoding="utf-8") as f:
        f.write(json.dumps(data))
    os.replace(tmp, path)


def open_log(log: Path, *, fresh: bool = False) -> int:
    """A file descriptor appending to the job's log, opened without following a link (a log
    file that is a symbolic link, which could lead anywhere, is refused: OSError naming it).
    `fresh`: created, or emptied when a stale job with the same id left one."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    if fresh:
        flags |= os.O_CREAT | os.O_TRUNC
    try:
        return os.open(log, flags, 0o644)
    except OSError as err:
        if log.is_symlink():
            raise OSError(err.errno, f"the job's log {log} is a symbolic link; it is never "
                          "followed: remove it") from None
        raise


def job_folder(folder: Path) -> None:
    """Make the job's folder (`<run>/.difftune-jobs`); refuse one that is, or lies under, a
    symbolic link, whose files would land wherever it leads."""
    folder.mkdir(parents=True, exist_ok=True)
    if folder.resolve() != folder.absolute():
        raise OSError(f"the job folder {folder} leads to {folder.resolve()} through a "
                      "symbolic link; remove the link (a job writes only in its run folder)")


def process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), or None
    when no such process runs (a zombie counts as gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the name, in parentheses, may hold spaces
    return None if fields[0] in ("Z", "X") else int(fields[19])


def is_alive(pid: int, start: int | None) -> bool:
    """Whether process `pid` runs and is the one that started at `start` (when known)."""
    if not Path("/proc/self/stat").exists():  # no procfs: fall back to a signal-0 probe
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    now = process_start(pid)
    return now is not None and (start is None or now == start)


def start_wrapper(python: str, argv: list[str], log: Path, record: Path, pidfile: Path,
                  cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the wrapper running `argv` in `cwd` (with `env` added), in a new session; write
    its pid file. Stale files of a job with the same id (a deleted database) are removed."""
    job_folder(log.parent)
    record.unlink(missing_ok=True)
    pidfile.unlink(missing_ok=True)
    fd = open_log(log, fresh=True)
    command = [python, "-m", "difftune.ui.jobs.launch", "--record", str(record),
               "--log", str(log), "--", *argv]
    # The wrapper starts with the stop signals blocked (a signal mask is inherited), so a stop
    # sent before it has set its handlers waits for them instead of killing it unrecorded.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        with os.fdopen(fd, "ab") as out:  # append: the wrapper and the CLI write to it too
            proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **env, "PYTHONUNBUFFERED": "1"})
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    write_json(pidfile, {"pid": proc.pid, "start": process_start(proc.pid)})
    return proc


def run(argv: list[str], log: Path, record: Path) -> int:
    """Run `argv` with its output appended to `log`, passing SIGTERM/SIGINT on to it; write
    the exit record; return the child's exit code."""
    child: list[subprocess.Popen[bytes]] = []
    early: list[int] = []  # signals that came before the child existed
    passed: list[str] = []

    def forward(signum: int, frame: object) -> None:
        passed.append(signal.Signals(signum).name)
        if child:
            child[0].send_signal(signum)
        else:
            early.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, forward)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the app's terminal closing is not a stop
    # Blocked by start_wrapper until now: one sent meanwhile arrives here, and the CLI must
    # not inherit the mask.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    with os.fdopen(open_log(log), "ab", buffering=0) as out:
        out.write(f"$ {shlex.join(argv)}\n".encode())
        try:
            child.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT))
        except OSError as err:
            out.write(f"error: cannot start {argv[0]}: {err.strerror}\n".encode())
            code = 127
        else:
            for signum in early:
                child[0].send_signal(signum)
            code = child[0].wait()
    killed = signal.Signals(-code).name if code < 0 else None
    write_json(record, {"exit_code": 128 - code if code < 0 else code, "ended": time.time(),
                        "signal": passed[0] if passed else None, "killed_by": killed})
    return code


def main(args: list[str] | None = None) -> int:
    """Entry point of `python -m difftune.ui.jobs.launch`."""
    parser = argparse.ArgumentParser(prog="python -m difftune.ui.jobs.launch",
                                     description="run one difftune job and record how it ended")
    parser.add_argument("--record", type=Path, required=True, help="exit record (JSON) to write")
    parser.add_argument("--log", type=Path, required=True, help="log file to append to")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command")
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        parser.error("give the command after --")
    code = run(argv, ns.log, ns.record)
    return 0 if code == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
