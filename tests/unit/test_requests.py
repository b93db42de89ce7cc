"""Requests to a training run ("sample now", "save now"): the request files, how the loop
honours them between steps (rank 0 reads, every process acts), the `difftune request` verb,
and GPU memory in the metrics rows."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import pytest
import torch

from difftune.cli import main
from difftune.report import metrics
from difftune.report.metrics import Reporter
from difftune.train import requests
from difftune.train.dist import Dist
from difftune.train.loop import Hooks, Interrupted, _between_steps
from difftune.train.rundir import RunLock, training_pid


# --- the request files -----------------------------------------------------------------------

def test_a_request_is_written_then_taken_once_and_its_folder_removed(tmp_path: Path) -> None:
    path = requests.make_request(tmp_path, "sample")
    requests.make_request(tmp_path, "save")
    requests.make_request(tmp_path, "save")  # twice is still one request
    assert path == tmp_path / "requests" / "sample" and path.is_file()
    assert requests.pending(tmp_path) == {"sample", "save"}  # a look deletes nothing
    assert requests.take_requests(tmp_path) == {"sample", "save"}
    assert not (tmp_path / "requests").exists()  # the next look is one failed stat
    assert requests.take_requests(tmp_path) == set()


def test_an_unknown_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown request 'stop'"):
        requests.make_request(tmp_path, "stop")  # type: ignore[arg-type]


def test_unknown_files_are_left_and_warned_about_once(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "requests"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    (folder / ".save-123.tmp").write_text("")  # a request being written: not a request yet
    requests.make_request(tmp_path, "save")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert requests.take_requests(tmp_path) == {"save"}
        assert requests.take_requests(tmp_path) == set()
    warned = [r for r in caplog.records if "notes.txt" in r.getMessage()]
    assert len(warned) == 1 and "ignored" in warned[0].getMessage()
    assert sorted(p.name for p in folder.iterdir()) == [".save-123.tmp", "notes.txt"]


def test_a_request_survives_its_folder_being_removed_under_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real, calls = requests.tempfile.mkstemp, []

    def racing(**kw: Any) -> tuple[int, str]:  # the loop removes the empty folder just now
        calls.append(1)
        if len(calls) == 1:
            (tmp_path / "requests").rmdir()
        return real(**kw)

    monkeypatch.setattr(requests.tempfile, "mkstemp", racing)
    assert requests.make_request(tmp_path, "save").is_file() and len(calls) == 2


# --- the loop honours them -------------------------------------------------------------------

@dataclass
class Saves:
    """A checkpoint manager that records what it was asked to write."""

    done: list[str] = field(default_factory=list)

    def save_lora(self, step: int, final: bool = False) -> Path:
        self.done.append(f"lora-{step}")
        return Path(f"lora-{step}")

    def save(self, state: Any) -> Path:
        self.done.append(f"checkpoint-{state.step}")
        return Path(f"checkpoint-{state.step}")


@dataclass(frozen=True)
class Rank1(Dist):
    """Rank 1 of two in one process: rank 0's flags for `any_of` are `rank0`."""

    rank0: tuple[bool, ...] = ()

    def any_of(self, flags: Sequence[bool]) -> list[bool]:
        return [a or b for a, b in zip(flags, self.rank0 or [False] * len(flags))]


def loop_parts(out: Path, dist: Dist = Dist(), step: int = 3, every: int | None = None,
               stop: bool = False, sampler: bool = True) -> tuple[Any, Hooks, Any, list[int]]:
    """A run, hooks (recording saves and samples) and a state after `step`."""
    cfg = SimpleNamespace(save=SimpleNamespace(every_n_steps=every),
                          sample=SimpleNamespace(every_n_steps=None, prompts=None))
    run = SimpleNamespace(cfg=cfg, out=out, dist=dist)
    sampled: list[int] = []
    runner = SimpleNamespace(run=lambda s: sampled.append(s)) if sampler else None
    hooks = Hooks(reporter=None, checkpoints=Saves(), sampler=runner,  # type: ignore[arg-type]
                  stop=lambda: stop)

    @contextlib.contextmanager
    def weights() -> Iterator[None]:
        yield

    state = SimpleNamespace(step=step, ema=None, eval_weights=weights)
    return run, hooks, state, sampled


def test_requests_are_honoured_after_the_current_step(tmp_path: Path) -> None:
    run, hooks, state, sampled = loop_parts(tmp_path)
    _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == [] and sampled == []  # nothing asked, nothing done
    requests.make_request(tmp_path, "sample")
    requests.make_request(tmp_path, "save")
    _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == ["lora-3", "checkpoint-3"] and sampled == [3]
    assert not (tmp_path / "requests").exists()


def test_a_save_request_on_a_scheduled_save_step_saves_once(tmp_path: Path) -> None:
    run, hooks, state, _ = loop_parts(tmp_path, every=3)
    requests.make_request(tmp_path, "save")
    _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == ["lora-3", "checkpoint-3"]
    assert requests.pending(tmp_path) == set()


def test_on_a_stop_save_is_honoured_and_sample_waits_for_the_resume(tmp_path: Path) -> None:
    run, hooks, state, sampled = loop_parts(tmp_path, stop=True)
    requests.make_request(tmp_path, "sample")
    requests.make_request(tmp_path, "save")
    with pytest.raises(Interrupted):
        _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == ["lora-3", "checkpoint-3"] and sampled == []
    assert requests.pending(tmp_path) == {"sample"}


def test_only_rank_0_reads_requests_and_every_rank_saves(tmp_path: Path) -> None:
    requests.make_request(tmp_path, "save")  # the same folder: rank 1 must not take it
    run, hooks, state, _ = loop_parts(tmp_path, dist=Rank1(1, 2), sampler=False)
    _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == [] and requests.pending(tmp_path) == {"save"}
    # Rank 0 read a save request: rank 1 joins the save (collective with FSDP).
    run, hooks, state, _ = loop_parts(tmp_path, dist=Rank1(1, 2, (False, False, True)),
                                      sampler=False)
    _between_steps(run, hooks, state, 3)
    assert hooks.checkpoints.done == ["lora-3", "checkpoint-3"]
    assert requests.pending(tmp_path) == {"save"}  # rank 0 deletes it, not rank 1


def test_a_sample_request_without_prompts_is_noted_and_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run, hooks, state, _ = loop_parts(tmp_path, sampler=False)
    requests.make_request(tmp_path, "sample")
    with caplog.at_level(logging.WARNING, logger="difftune"):
        _between_steps(run, hooks, state, 3)
    assert "no sample.prompts" in caplog.text and requests.pending(tmp_path) == set()


def test_any_of_on_one_process_is_the_flags_themselves() -> None:
    assert Dist().any_of([True, False, True]) == [True, False, True]
    assert Dist().any(False) is False


# --- difftune request ------------------------------------------------------------------------

def test_request_verb_writes_the_file_and_says_what_happens(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.resolved.json").write_text(json.dumps(
        {"save": {"name": "cat"}, "sample": {"prompts": None}}))
    assert main(["request", "save", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "requests" / "save").is_file()
    assert "cat-stepNNNNNN.safetensors" in out and "no run is training there now" in out
    assert main(["request", "sample", str(tmp_path)]) == 0
    assert "no sample.prompts" in capsys.readouterr().out
    with RunLock(tmp_path):  # a run holds the folder: its pid is named
        assert main(["request", "save", str(tmp_path)]) == 0
        assert f"pid {os.getpid()}" in capsys.readouterr().out


def test_request_verb_refuses_a_folder_that_is_no_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["request", "save", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a run folder" in err and "config.resolved.json" in err
    assert "Traceback" not in err and not (tmp_path / "requests").exists()
    assert main(["request", "sample", str(tmp_path / "missing")]) == 2


def test_training_pid_is_none_without_a_run(tmp_path: Path) -> None:
    assert training_pid(tmp_path) is None and training_pid(tmp_path / "missing") is None


# --- GPU memory in the metrics rows ----------------------------------------------------------

def test_rows_carry_gpu_memory_on_cuda_only(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU run
    assert metrics.gpu_memory() == {}
    reporter = Reporter(tmp_path, 2, tensorboard=False, bar=False)
    reporter.step(1, 0.5, 1e-3)
    resets: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**29)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: resets.append(1))
    reporter.step(2, 0.4, 1e-3)
    reporter.close()
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "gpu_mem_gib" not in rows[0] and rows[1]["gpu_mem_gib"] == 1.5
    assert resets == [1]  # the next row's figure is the peak since this one
