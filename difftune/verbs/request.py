"""`difftune request sample|save RUN_DIR`: ask a training run to sample or save after its
current step (the web app's "sample now" and "save now" buttons do the same).

The request is a file in the run folder (difftune/train/requests.py); this verb writes it and
says what will happen: whether a run trains there now, and what it will write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftune.errors import ConfigError
from difftune.train.requests import KINDS, SAMPLE, Kind, make_request
from difftune.train.rundir import training_pid

MARKERS = ("config.resolved.json", "metrics.jsonl")


def run_request(run_dir: Path, kind: Kind) -> list[str]:
    """Write the `kind` request into `run_dir` (a run's save.dir); returns the lines that say
    what will happen. Raises `ConfigError` when `run_dir` is not a run folder."""
    if kind not in KINDS:
        raise ConfigError(f"unknown request {kind!r}; one of: {', '.join(KINDS)}")
    if not run_dir.is_dir() or not any((run_dir / m).is_file() for m in MARKERS):
        raise ConfigError(f"{run_dir} is not a run folder (it has no {' or '.join(MARKERS)}); "
                          "give the save.dir of a run that difftune train started")
    path = make_request(run_dir, kind)
    cfg = _resolved(run_dir)
    lines = [f"request written: {path}", _what(kind, run_dir, cfg)]
    pid = training_pid(run_dir)
    if pid:
        lines.append(f"the run training there (pid {pid}) honours it after its current step")
    else:
        lines.append("no run is training there now: it is honoured after the first step of "
                     "the next one in that folder (difftune train ... --resume latest)")
    return lines


def _resolved(run_dir: Path) -> dict[str, Any]:
    """The run's resolved config ({} when absent or unreadable: the message is then vaguer)."""
    try:
        return json.loads((run_dir / "config.resolved.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _what(kind: str, run_dir: Path, cfg: dict[str, Any]) -> str:
    """What the run will write for `kind`."""
    if kind == SAMPLE:
        if cfg and not (cfg.get("sample") or {}).get("prompts"):
            return "sample: this run has no sample.prompts, so nothing will be sampled"
        return f"sample: its prompts are sampled into {run_dir / 'samples'} (step-NNNNNN_*.png)"
    name = (cfg.get("save") or {}).get("name", "lora")
    return (f"save: {run_dir / f'{name}-stepNNNNNN.safetensors'} and a resume checkpoint "
            f"{run_dir / 'checkpoints' / 'step-NNNNNN'} (save.keep_last applies)")
