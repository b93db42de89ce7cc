"""`difftune demo` really learns: each prompt's final sample is nearest its own training image.

Tiers: the full-length demo (`test_demo_learns`, the packaged 800 steps) is `full_only`. The
default tier runs the same demo shortened (the module's `short_demo`, read by two tests):
every output file, the samples of every prompt before the first step and after the last, the
report, and that the untrained samples do not match their prompts; only "after training every
prompt's sample matches" and the halved loss need the full length, so only `--full` asserts it.
The short demo's final samples, measured by `difftune runs rank` with the tiny random DINOv2,
are not flagged as copies (docs/training-signal.md: the closest-pair rule flagged them)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from difftune.cli import main
from difftune.verbs.demo import demo_config_path, nearest_images
from difftune.verbs.demo import demo_dir
from difftune.report.plots import read_metric
from difftune.sample.runner import PromptSpec, read_prompts


@pytest.mark.full_only
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


SHORT = 12  # steps of the default tier's demo: samples at 0, 4, 8, 12


@pytest.fixture(scope="module")
def short_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`difftune demo --steps 12`: its output folder and the report it printed."""
    out = tmp_path_factory.mktemp("short") / "demo"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["demo", "--out", str(out), "--steps", str(SHORT)]) == 0
    return out, printed.getvalue()


def test_short_demo_writes_and_reports_everything(short_demo: tuple[Path, str]) -> None:
    out, report = short_demo
    for name in ("before_after.png", "loss.png", "demo-lora.safetensors", "metrics.jsonl"):
        assert (out / name).is_file(), name
    prompts = read_prompts(demo_dir() / "prompts.txt", PromptSpec("", "", 64, 64, 8, 0, 1.0, 1.0))
    assert [s for s, _ in read_metric(out / "metrics.jsonl")] == list(range(1, SHORT + 1))
    samples = out / "samples"
    before = [next(samples.glob(f"step-000000_{i:02d}_*.png")) for i in range(len(prompts))]
    assert all(next(samples.glob(f"step-{SHORT:06d}_{i:02d}_*.png")) for i in range(len(prompts)))
    # Before training the samples do not match their prompts.
    baseline = nearest_images(before, prompts, demo_dir())
    assert baseline.matched < len(prompts)
    assert (f"samples nearest to their own training image: before {baseline.matched}/"
            f"{len(prompts)}, after ") in report
    assert demo_config_path().is_file()


@pytest.fixture(scope="module")
def demo_run(short_demo: tuple[Path, str]) -> Any:
    """The short demo's run loaded again from its resolved config (model, data, caches)."""
    from difftune.config import parse_config
    from difftune.train.setup import prepare

    out = short_demo[0]
    return prepare(parse_config(json.loads((out / "config.resolved.json").read_text()), out),
                   show_progress=False)


def test_the_short_demos_samples_are_not_flagged_as_copies(
        short_demo: tuple[Path, str], demo_run: Any, scorer_models: tuple,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Its LoRA's samples (six subjects, one image each: learning, not copying) measured by
    `difftune runs rank` against each training image's copy floor: with the run's VAE copies
    listed (what a run with [metrics] measures against), and without (the images)."""
    from difftune.report.metric_worker import training_images
    from difftune.report.vae_copies import run_copies

    out, _ = short_demo
    for listed in (False, True):
        if listed:  # as a run with [metrics] lists them when it starts
            copies = run_copies(demo_run, training_images(demo_run.data.items))
            assert copies is not None and len(copies) == 6
            assert json.loads((out / "vae_copies.json").read_text()) == {
                str(t): str(c) for t, c in zip(training_images(demo_run.data.items), copies)}
        assert main(["runs", "rank", str(out), "--json", "--dino", str(scorer_models[0])]) == 0
        [entry] = json.loads(capsys.readouterr().out)["checkpoints"]
        assert entry["step"] == SHORT and entry["measured_now"] and len(entry["samples"]) == 6
        assert 0 < entry["figures"]["nearest_similarity"] < 1
        assert entry["copying"] is False


def test_vae_copies_that_cannot_be_made_leave_the_run_going(
        demo_run: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cache folder that cannot be written: a warning, and memorization falls back to the
    training images themselves (None), rather than the run stopping."""
    from dataclasses import replace

    from difftune.report.metric_worker import training_images
    from difftune.report.vae_copies import run_copies

    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would be")
    cfg = demo_run.cfg
    cfg = cfg.model_copy(update={"cache": cfg.cache.model_copy(update={"dir": blocked}),
                                 "save": cfg.save.model_copy(update={"dir": tmp_path})})
    assert run_copies(replace(demo_run, cfg=cfg), training_images(demo_run.data.items)) is None
    assert "VAE copies could not be made" in caplog.text
    assert not (tmp_path / "vae_copies.json").exists()
