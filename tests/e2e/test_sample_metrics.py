"""Sample metrics in a real run through the CLI: a LoRA trained to copy one image.

The copy rule: a sample is a copy of its nearest training image when it is as similar to it
as the image's own degraded copies are (JPEG, noise, half-size resampling: its copy floor,
0.98-0.996 for the demo's shapes under the tiny random DINOv2). The demo (six subjects, one
image each) is not flagged (tests/e2e/test_demo.py measures the suite's short demo); under
the earlier reference (the closest pair of distinct training images, 0.744) the short demo
was flagged at steps 4, 8 and 12 (0.75-0.86, for a red-circle sample nearest the white
triangle: not even its own image).

No tiny-flavor run draws a copy at the floor: the tiny VAE alone keeps a training image only
to 0.92-0.975 under the same features (docs/training-signal.md has the figures), so a LoRA
trained to reproduce one image gets to 0.82 and no further. The copy run below therefore sets
`metrics.copy_similarity = 0.75` (a fixed threshold, the override a user has): its untrained
baseline (step 0) is far from the image (0.43), its trained samples reach 0.82, so the warning
must fire at the trained events and not at the baseline, and fidelity must rise with training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from difftune.cli import main
from difftune.config.metrics import MetricsConfig
from difftune.report.sample_metrics import measure, read_sample, reference
from difftune.report.scoring import Scorers
from tests.e2e.conftest import run_toml


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory: pytest.TempPathFactory, images: Path,
             scorer_models: tuple) -> Path:
    """A 60-step run on the red circle alone, sampled at 0, 30 and 60 at two seeds."""
    folder = tmp_path_factory.mktemp("copy")
    data = folder / "data"
    data.mkdir()
    for name in ("red_circle.png", "red_circle.txt"):
        shutil.copy(images / name, data / name)
    prompts = folder / "prompts.txt"
    prompts.write_text("a red circle on a blue background --w 64 --h 64 --s 8 --d 1\n"
                       "a red circle on a blue background --w 64 --h 64 --s 8 --d 2\n",
                       encoding="utf-8")
    dino, clip = scorer_models
    extra = (f'\n[metrics]\nenabled = true\ndino = "{dino.as_posix()}"\n'
             f'clip = "{clip.as_posix()}"\ncopy_similarity = 0.75\n')
    cfg = run_toml(folder, data, extra, steps=60, prompts=prompts)
    assert main(["train", str(cfg), "--no-progress", "--set", "train.batch_size=1",
                 "--set", "train.lr=8e-3", "--set", "sample.every_n_steps=30",
                 "--set", "save.every_n_steps=30",
                 "--set", "save.keep_best=0.7*fidelity + 0.3*clip_score/100"]) == 0
    return folder / "out"


def _events(out: Path) -> dict[int, dict]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r.get("event") == "samples"}


def test_fidelity_rises_and_the_copy_is_flagged(copy_run: Path) -> None:
    events = _events(copy_run)
    assert sorted(events) == [0, 30, 60]
    assert events[60]["fidelity"] > events[0]["fidelity"] + 0.3
    assert not events[0]["copying"] and events[60]["copying"]
    assert {s["nearest"] for s in events[60]["sample_metrics"]["samples"]} == {"red_circle.png"}
    assert "diversity" in events[60] and "clip_score" in events[60]
    log = (copy_run / "difftune.log").read_text()
    assert "samples at step 60 look copied from the training data" in log
    assert "samples at step 0 look copied" not in log


def test_rows_equal_the_metrics_of_the_saved_samples(copy_run: Path,
                                                     scorer_models: tuple) -> None:
    dino, clip = scorer_models
    scorers = Scorers.load(MetricsConfig(enabled=True, dino=dino, clip=clip))
    ref = reference(scorers, [copy_run.parent / "data" / "red_circle.png"],
                    copy_run / "cache", 0.75)
    files = sorted((copy_run / "samples").glob("step-000030_0*.png"))
    samples = [read_sample(p) for p in files]
    assert [s.prompt for s in samples] == ["a red circle on a blue background"] * 2
    again = measure(scorers, ref, samples)
    row = _events(copy_run)[30]
    for key in ("fidelity", "clip_score", "diversity", "nearest_similarity"):
        assert row[key] == pytest.approx(again[key], abs=1e-6)


def test_keep_best_keeps_the_step_the_weighted_metrics_choose(copy_run: Path) -> None:
    from safetensors.torch import load_file

    events = _events(copy_run)
    score = {s: 0.7 * e["fidelity"] + 0.3 * e["clip_score"] / 100 for s, e in events.items()}
    best = max(score, key=score.get)
    record = json.loads((copy_run / "best.json").read_text())
    assert record["best_step"] == best and record["best"] == pytest.approx(score[best])
    assert record["scores"] == {str(s): pytest.approx(v) for s, v in score.items()}
    last = max(score)
    assert record["margin_over_last"] == pytest.approx(score[best] - score[last])
    kept = load_file(str(copy_run / "lora-best.safetensors"))
    same = (copy_run / "lora.safetensors" if best == 60 else
            copy_run / "checkpoints" / f"step-{best:06d}" / "lora.safetensors")
    if best == 0:  # the untrained LoRA: its up factors are zero
        assert all(not v.any() for k, v in kept.items() if "lora_B" in k or "up" in k)
    else:
        reference = load_file(str(same))
        assert kept.keys() == reference.keys()
        assert all(torch.equal(kept[k], reference[k]) for k in kept)
    assert not (copy_run / ".best-candidates").exists()
    from difftune.ui.runs import summary  # what the run page and /api/runs say

    assert summary(copy_run).best.startswith(f"best: step {best} (0.7*fidelity")
    log = (copy_run / "difftune.log").read_text()
    assert f"best checkpoint by 0.7*fidelity + 0.3*clip_score/100: step {best}" in log


def test_tensorboard_has_the_sample_scalars(copy_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(copy_run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for key in ("fidelity", "clip_score", "diversity", "nearest_similarity"):
        assert f"samples/{key}" in tags
    assert [e.step for e in acc.Scalars("samples/fidelity")] == [0, 30, 60]


def test_keep_best_by_validation_loss_keeps_its_lowest_step(tmp_path: Path,
                                                            images: Path) -> None:
    from safetensors.torch import load_file

    cfg = run_toml(tmp_path, images, steps=4, extra="\n[validation]\nenabled = true\n"
                   "fraction = 0.34\nevery_n_steps = 1\n")
    assert main(["train", str(cfg), "--no-progress", "--set", "save.every_n_steps=1",
                 "--set", "save.keep_best=val_loss"]) == 0
    out = tmp_path / "out"
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    best = min(val, key=val.get)
    record = json.loads((out / "best.json").read_text())
    assert record["best_step"] == best and not record["higher_is_better"]
    kept = load_file(str(out / "lora-best.safetensors"))
    step = load_file(str(out / "checkpoints" / f"step-{best:06d}" / "lora.safetensors"))
    assert all(torch.equal(kept[k], step[k]) for k in step)


def test_runs_rank_orders_checkpoints_by_the_runs_keep_best(
        copy_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["runs", "rank", str(copy_run), "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    assert ranked["by"] == "0.7*fidelity + 0.3*clip_score/100"
    events = _events(copy_run)
    score = {s: 0.7 * events[s]["fidelity"] + 0.3 * events[s]["clip_score"] / 100
             for s in (30, 60)}  # the steps with a LoRA (none at step 0)
    assert [c["step"] for c in ranked["checkpoints"]] == sorted(score, key=score.get,
                                                                 reverse=True)
    assert all(c["score"] == pytest.approx(score[c["step"]]) and not c["measured_now"]
               for c in ranked["checkpoints"])
    assert main(["runs", "rank", str(copy_run), "--by", "nearest_similarity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["#", "run", "step", "nearest_similarity"]
    near = {s: events[s]["nearest_similarity"] for s in (30, 60)}
    assert int(lines[1].split()[2]) == min(near, key=near.get)  # lower is better


def test_runs_rank_measures_samples_a_run_never_measured(
        copy_run: Path, tmp_path: Path, scorer_models: tuple,
        capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(copy_run, bare)
    rows = (bare / "metrics.jsonl").read_text().splitlines()
    (bare / "metrics.jsonl").write_text("".join(r + "\n" for r in rows if '"event"' not in r))
    cfg = json.loads((bare / "config.resolved.json").read_text())
    cfg["metrics"] = {"enabled": False}
    (bare / "config.resolved.json").write_text(json.dumps(cfg))
    assert main(["runs", "rank", str(bare), "--by", "fidelity"]) == 2
    assert "--dino" in capsys.readouterr().err
    dino, clip = scorer_models
    assert main(["runs", "rank", str(bare), "--json", "--dino", str(dino),
                 "--clip", str(clip)]) == 0
    ranked = json.loads(capsys.readouterr().out)["checkpoints"]
    events = _events(copy_run)
    for c in ranked:
        assert c["measured_now"]
        for key in ("fidelity", "clip_score", "nearest_similarity"):
            assert c["figures"][key] == pytest.approx(events[c["step"]][key], abs=1e-6)
        closest = c["closest"]  # the sample nearest to a copy, measured now as the run did
        assert closest["similarity"] <= c["figures"]["nearest_similarity"] + 1e-6
        assert (closest["similarity"] >= closest["floor"]) == c["copying"]


def test_check_loads_the_metric_models_and_refuses_a_broken_one(
        copy_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy_run.parent / "run.toml"
    out = ["--set", f"save.dir={(tmp_path / 'out').as_posix()}"]
    assert main(["check", str(cfg), "--no-progress", *out]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ok  metrics:"))
    assert "1 training images, copy floor 0.7500 (a sample this similar is a copy)" in line
    broken = tmp_path / "dino"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert main(["check", str(cfg), "--no-progress", *out,
                 "--set", f"metrics.dino={broken.as_posix()}"]) == 2
    assert f"metrics.dino: {broken}" in capsys.readouterr().err
