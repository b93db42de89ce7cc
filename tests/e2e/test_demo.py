"""`difftune demo` really learns: each prompt's final sample is nearest its own training image."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftune.cli import main
from difftune.verbs.demo import demo_config_path, nearest_images
from difftune.verbs.demo import demo_dir
from difftune.report.plots import read_metric
from difftune.sample.runner import PromptSpec, read_prompts


def test_demo_learns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    for name in ("before_after.png", "loss.png", "demo-lora.safetensors", "metrics.jsonl"):
        assert (out / name).is_file(), name
    prompts = read_prompts(demo_dir() / "prompts.txt", PromptSpec("", "", 64, 64, 8, 0, 1.0, 1.0))
    steps = len(read_metric(out / "metrics.jsonl"))
    samples = out / "samples"
    before = [next(samples.glob(f"step-000000_{i:02d}_*.png")) for i in range(len(prompts))]
    after = [next(samples.glob(f"step-{steps:06d}_{i:02d}_*.png")) for i in range(len(prompts))]
    baseline = nearest_images(before, prompts, demo_dir())
    learned = nearest_images(after, prompts, demo_dir())
    # Before training the samples do not match their prompts; after, every one does.
    assert baseline.matched < len(prompts)
    assert learned.matched == len(prompts), (learned.prompts, learned.nearest)
    losses = [v for _, v in read_metric(out / "metrics.jsonl")]
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    assert f"after {len(prompts)}/{len(prompts)}" in report
    assert demo_config_path().is_file()
