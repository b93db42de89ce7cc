"""What the run page reads at each refresh of a long run (thousands of samples, hundreds of
checkpoints): only what changed. A refresh with nothing changed lists no folder and opens no
file of the run's samples and checkpoints (seen through Python's audit hooks, which every
`open` and `os.scandir` raises); a new sample is found by one listing. And what resuming from
an earlier checkpoint of a real run would replace."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from difftune.ui import lora_samples, run_outputs
from difftune.ui.resume_from import replaced_by_resume
from difftune.ui.security import Roots
from tests.ui import tiny_run

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c6360000002000001e221bc330000000049454e44ae426082")
_events: list[tuple[str, str]] = []
_watching: list[bool] = []


def _hook(event: str, args: tuple[Any, ...]) -> None:
    """Record the files opened and the folders listed while a test watches."""
    if _watching and event in ("open", "os.scandir", "os.listdir") and args:
        _events.append((event, os.fsdecode(args[0]) if isinstance(args[0], (str, bytes,
                                                                         os.PathLike)) else ""))


sys.addaudithook(_hook)


def make_long_run(run: Path, steps: int, prompts: int, checkpoints: int) -> Path:
    """A run folder as a long run leaves it: `steps` sample events of `prompts` images (tiny
    PNGs), `checkpoints` checkpoint folders with a LoRA file each, its prompt file."""
    (run / "samples").mkdir(parents=True)
    texts = [f"prompt number {i}" for i in range(prompts)]
    (run / "prompts.txt").write_text("".join(f"{t} --d {i + 10}\n" for i, t in enumerate(texts)))
    (run / "config.resolved.json").write_text(json.dumps(
        {"sample": {"prompts": str(run / "prompts.txt"), "seed": 0}, "train": {"steps": 10**6},
         "save": {"name": "lora"}}))
    for step in range(steps):
        for i, text in enumerate(texts):
            (run / "samples" / f"step-{step * 10:06d}_{i:02d}_{text.replace(' ', '-')}.png") \
                .write_bytes(PNG)
    for n in range(checkpoints):
        folder = run / "checkpoints" / f"step-{n * 10:06d}"
        folder.mkdir(parents=True)
        (folder / "state.json").write_text("{}")
        save_file({"a": np.zeros(2, dtype=np.float32)}, str(folder / "lora.safetensors"),
                  metadata={"difftune.rank": "4", "difftune.steps": str(n * 10)})
    return run


def settle(folder: Path) -> None:
    """Date every file and folder under `folder` 10 s back, as a run's files are once it has
    moved on (a stamp younger than a second is never trusted: see file_cache)."""
    past = time.time() - 10
    for path in [folder, *folder.rglob("*")]:
        os.utime(path, (past, past))


def _touching(events: list[tuple[str, str]], *folders: Path) -> list[tuple[str, str]]:
    return [e for e in events if any(e[1].startswith(str(f)) for f in folders)]


def test_a_refresh_with_nothing_changed_reads_no_sample_or_checkpoint(tmp_path: Path) -> None:
    run = make_long_run(tmp_path / "run", steps=100, prompts=30, checkpoints=50)
    settle(run)
    roots = Roots.of([tmp_path])
    first = run_outputs.samples(run, roots)
    files = run_outputs.files(run, roots)
    assert len(first) == 3000 and len(files) == 50
    assert (first[31].prompt, first[31].seed, first[31].step) == ("prompt number 1", 11, 10)
    _events.clear()
    _watching.append(True)
    try:
        again = run_outputs.samples(run, roots)
        files_again = run_outputs.files(run, roots)
        lora_samples.sample_sets(run, roots)
    finally:
        _watching.clear()
    assert again is first and files_again == files
    assert _touching(_events, run / "samples", run / "checkpoints", run / "prompts.txt",
                     run / "config.resolved.json") == []
    # A new sample event: one listing of the samples folder finds it; no sample file opened.
    (run / "samples" / "step-999999_00_prompt-number-0.png").write_bytes(PNG)
    settle(run)
    _events.clear()
    _watching.append(True)
    try:
        newer = run_outputs.samples(run, roots)
    finally:
        _watching.clear()
    assert len(newer) == 3001 and newer[-1].step == 999999
    assert _touching(_events, run / "samples") == [("os.scandir", str(run / "samples"))]


def test_a_checkpoint_rewritten_in_place_is_read_again(tmp_path: Path) -> None:
    run = make_long_run(tmp_path / "run", steps=1, prompts=1, checkpoints=2)
    settle(run)
    before = run_outputs.files(run)
    assert [f.metadata["difftune.steps"] for f in before] == ["0", "10"]
    folder = run / "checkpoints" / "step-000010"
    save_file({"a": np.zeros(2, dtype=np.float32)}, str(folder / "lora.safetensors"),
              metadata={"difftune.rank": "4", "difftune.steps": "11"})
    (folder / "extra.json").write_text("{}")  # the folder changes: read again
    settle(run)
    assert [f.metadata["difftune.steps"] for f in run_outputs.files(run)] == ["0", "11"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run.make(tmp_path_factory)


def test_resume_from_an_earlier_checkpoint_says_what_it_replaces(tiny: Path) -> None:
    later = replaced_by_resume(tiny, 2)
    assert later.checkpoints == ["step-000004"]
    assert later.weights == ["demo-lora.safetensors"]  # the final file, written again
    assert (later.samples, later.sample_steps, later.metric_rows) == (2, 1, 2)
    text = "\n".join(later.lines())
    assert "step-000004" in text and "2 sample image(s) of 1 later step(s)" in text
    last = replaced_by_resume(tiny, 4)
    assert last.checkpoints == [] and last.samples == 0 and last.metric_rows == 0
