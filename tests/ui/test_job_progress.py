"""What the jobs list shows of a run (difftune.ui.jobs.progress): read from the run folder,
re-read only when it changed, the newest sample found by its name alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

from difftune.ui.jobs.progress import clock, last_sample, progress
from difftune.ui.security import Roots


def _rows(run_dir: Path, steps: range) -> None:
    """Append metrics rows for `steps` (loss 1/step, 4 it/s, smoothed loss twice that)."""
    with (run_dir / "metrics.jsonl").open("a") as f:
        for s in steps:
            f.write(json.dumps({"step": s, "loss": 1 / s, "loss_smoothed": 2 / s,
                                "it_per_s": 4.0}) + "\n")


def test_progress_follows_the_run_folder(tmp_path: Path) -> None:
    roots = Roots.of([tmp_path])
    run_dir = tmp_path / "runs" / "my-run"
    (run_dir / "samples").mkdir(parents=True)
    (run_dir / "config.resolved.json").write_text(json.dumps({"train": {"steps": 100}}))
    _rows(run_dir, range(1, 21))
    first = progress(run_dir, roots)
    assert (first.name, first.step, first.total, first.eta_s, first.loss, first.sample,
            first.finished) == ("my-run", 20, 100, 20.0, 0.1, None, False)
    assert progress(run_dir, roots) is first  # nothing changed: nothing re-read
    _rows(run_dir, range(21, 41))
    (run_dir / "samples" / "step-000040_00_a-cat.png").write_bytes(b"png")
    later = progress(run_dir, roots)
    assert (later.step, later.eta_s, later.sample) == \
        (40, 15.0, str(run_dir / "samples" / "step-000040_00_a-cat.png"))
    _rows(run_dir, range(41, 101))
    (run_dir / "lora.safetensors").write_bytes(b"{}")
    done = progress(run_dir, roots)
    assert (done.step, done.eta_s, done.finished) == (100, None, True)


def test_the_newest_sample_is_the_first_prompt_of_the_latest_step(tmp_path: Path) -> None:
    samples = tmp_path / "root" / "run" / "samples"
    samples.mkdir(parents=True)
    roots = Roots.of([tmp_path / "root"])
    assert last_sample(samples.parent, roots) is None
    for name in ("step-000100_00_a.png", "step-000900_01_b.png", "step-000900_00_c.png",
                 "step-000090_00_d.png", "step-000900_grid.png", "base_00_e.png", "notes.txt"):
        (samples / name).write_bytes(b"png")
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(b"png")
    os.symlink(outside, samples / "step-001000_00_link.png")  # leads outside the roots
    assert last_sample(samples.parent, roots) == str(samples / "step-000900_00_c.png")


def test_clock() -> None:
    assert [clock(s) for s in (5, 65.9, 3600 * 2 + 61)] == ["0:05", "1:05", "2:01:01"]
