"""A job's state read back from the truth: its wrapper process and its run folder.

A running job stays running only while its wrapper lives (same pid AND same start time, so
a reused pid does not count); once the wrapper has written its exit record the job is
succeeded, stopped or failed (with the CLI's own error lines); a wrapper gone without a
record (killed, machine rebooted) makes the job `died`, naming the last line it logged.
Nothing is kept only in memory, so a restarted app derives the same states.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from difftune.ui.jobs import cluster
from difftune.ui.jobs.launch import is_alive
from difftune.ui.jobs.store import LIVE, Job

# What the CLI prints on failure: `error: ...` (a user-fixable problem, possibly followed by
# indented detail lines) or `internal error...`, with `[rank N] ` before it under a launch;
# a bad command line: argparse's `difftune <verb>: error: ...`.
ERROR_LINE = re.compile(r"^(\[rank \d+\] |difftune( \w+)?: )?(error|internal error)\b.*:")
# What `difftune train` prints when a stop signal ended it after a step, checkpoint saved.
STOPPED_LINE = re.compile(r"^(\[rank \d+\] )?stopped after step \d+")
# What `difftune train` prints last on success (cli.py `_train`).
WRITTEN_LINE = re.compile(r"^(?:LoRA|fine-tuned model) written to (.+)$")
ERROR_LINES_MAX = 40
TAIL_BYTES = 256 * 1024  # how much of a log's end is read to find its last error


def derive(job: Job) -> Job:
    """`job` with its state, exit code, error and files as its process and run folder say."""
    job = replace(job, checkpoints=checkpoints(job.run_dir),
                  loras=[p.name for p in lora_files(job.run_dir)])
    if job.state not in LIVE:
        return job
    record = read_record(job.record)
    if record is None and wrapper_alive(job):
        return job
    record = record or read_record(job.record)  # it may have ended between the two looks
    if record is None:
        last = last_line(job.log)
        return replace(job, state="died", ended=time.time(), error=(
            f"the job's process ended without an exit record (killed, out of memory, or the "
            f"machine restarted); its last log line: {last or '(the log is empty)'}"))
    if cluster.is_slurm(job.device):
        followed = cluster.follow(job, record, tail_lines(job.log, 50))
        if followed is not None:
            return followed
    return finish(job, record)


def finish(job: Job, record: dict[str, Any]) -> Job:
    """`job` ended as its exit record says: stopped (a stop signal was passed on, and the CLI
    either said "stopped after step N" and exited 0, as training does, or was ended by that
    signal), succeeded (exit 0: it may have finished before the stop reached it) or failed
    (with the CLI's error lines)."""
    code = int(record.get("exit_code", 1))
    ended = record.get("ended") or time.time()
    asked = record.get("signal")
    said = code == 0 and any(STOPPED_LINE.match(line) for line in tail_lines(job.log, 50))
    if asked is not None and (said or record.get("killed_by") == asked):
        return replace(job, state="stopped", exit_code=code, ended=ended, error=None)
    if code == 0:
        missing = missing_output(job)
        if missing:
            return replace(job, state="failed", exit_code=0, ended=ended, error=missing)
        return replace(job, state="succeeded", exit_code=0, ended=ended, error=None)
    error = error_text(job.log)
    if error is None:
        how = f"was killed by {record['killed_by']}" if record.get("killed_by") \
            else f"exited with code {code}"
        error = f"the command {how}; its last log line: {last_line(job.log) or '(none)'}"
    return replace(job, state="failed", exit_code=code, ended=ended, error=error)


def wrapper_alive(job: Job) -> bool:
    """Whether the job's wrapper process still runs (its pid file's pid and start time)."""
    try:
        info = json.loads(job.pidfile.read_text(encoding="utf-8"))
        pid, start = int(info["pid"]), info.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        if job.pid is None:
            return False
        pid, start = job.pid, None  # the run folder lost the file: trust the pid alone
    return is_alive(pid, start)


def read_record(path: Path) -> dict[str, Any] | None:
    """The wrapper's exit record, or None while there is none (written atomically: a record
    that exists is complete)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def error_text(log: Path) -> str | None:
    """The CLI's last error, verbatim: the last `error: ...` / `internal error ...` line of
    the log and the lines after it (the problems it lists, where the run was saved)."""
    lines = tail_lines(log, 400)
    for i in range(len(lines) - 1, -1, -1):
        if ERROR_LINE.match(lines[i]):
            block = [line for line in lines[i:i + ERROR_LINES_MAX] if line.strip()]
            return "\n".join(block)
    return None


def _no_follow(path: str, flags: int) -> int:
    """`open`'s opener that refuses a symbolic link (OSError)."""
    return os.open(path, flags | os.O_NOFOLLOW)


def last_line(log: Path) -> str | None:
    """The log's last non-empty line."""
    lines = [line for line in tail_lines(log, 20) if line.strip()]
    return lines[-1].strip() if lines else None


def tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines of a text file (read from its end only), [] if it is missing.
    Carriage returns (progress bars redrawn in place) end lines too. A log reached through
    a symbolic link (itself or its folder) is not read, as it could lead to any file: [] as
    for a missing one (a job's run folder is stored with its links resolved)."""
    if os.path.realpath(path) != os.path.abspath(path):
        return []
    try:
        with open(path, "rb", opener=_no_follow) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    out = lines.split("\n")
    if size > TAIL_BYTES:
        out = out[1:]  # the first line read is likely cut
    if out and out[-1] == "":
        out = out[:-1]
    return out[-count:] if count > 0 else []


def missing_output(job: Job) -> str | None:
    """For a train job that exited 0: None when the file it says it wrote ("LoRA written to
    PATH" / "fine-tuned model written to PATH") exists, else why the job is not a success (a
    run reported complete with no file written is a failure, whatever the exit code)."""
    if job.verb != "train":
        return None
    for line in reversed(tail_lines(job.log, 50)):
        found = WRITTEN_LINE.match(line)
        if found:
            text = found.group(1).strip()
            if _written(text):
                return None
            return f"the run said it wrote {text}, but there is no such file or folder"
    return ("the run exited without error but printed no 'written to' line: no LoRA or model "
            "file was reported; see its log for the last step it reached")


def _written(text: str) -> bool:
    """Whether the files a "written to" line names exist: one path, or two joined by " and "
    (a two-expert model's pair, cli.py) at whichever " and " splits it into two that exist
    (a folder's own name may hold one)."""
    if Path(text).exists():
        return True
    parts = text.split(" and ")
    return any(Path(" and ".join(parts[:i])).exists() and Path(" and ".join(parts[i:])).exists()
               for i in range(1, len(parts)))


def checkpoints(run_dir: Path) -> list[str]:
    """The complete resume checkpoints in `run_dir/checkpoints` (folders `step-NNNNNN` with a
    state.json, written last), oldest first: what `--resume latest` would pick from. Kept
    free of torch, unlike train/checkpoint/files.py, so the app stays light."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.glob("step-*") if (p / "state.json").is_file())


def lora_files(run_dir: Path) -> list[Path]:
    """The LoRA files the run wrote: `<save.name>.safetensors` at the end and
    `<save.name>-stepNNNNNN.safetensors` along the way, directly in the run folder."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.glob("*.safetensors") if p.is_file())
