"""Sample metrics in a real run through the CLI: a LoRA trained to copy one image.

The copy rule: a sample is a copy of its nearest training image when it is as similar to that
image's VAE copy (the decode of its own latent, report/vae_copies.py) as the VAE copy's own
degraded copies are (JPEG, noise, half-size resampling: its copy floor, 0.9975 for the red
circle under the tiny random DINOv2). The demo (six subjects, one image each) is not flagged
(tests/e2e/test_demo.py; docs/training-signal.md has the 800-step demo's figures).

The copy run overtrains as a user who wants one picture back would: the red circle alone, a
batch of four of it, rank 32, every linear layer of the denoiser including its input and output
projections (the tiny base's transformer is random: it never learned to denoise, so a LoRA on
its blocks alone cannot reproduce a picture; docs/training-signal.md). Its samples are drawn in
one step (the denoiser's prediction from pure noise), so the run draws its timesteps near pure
noise (shift 10) and takes AdamW's steps unclipped, without weight decay, with beta2 0.99 and a
cosine decay: that copies in 240 steps where uniform timesteps and 8-step samples took 360 by a
thinner margin. At the end the samples reproduce the circle's latent (0.9992 to its VAE copy,
0.0016 above the floor, three of the four seeds past it by 0.0015), so the default rule must
flag them, and not the untrained baseline (0.56); fidelity must rise with training. The
half-way event is not asserted: it is past the floor by only 0.0011.
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
from difftune.report.vae_copies import read_index
from tests.e2e.conftest import run_toml

STEPS, HALF = 240, 120  # the run's length; it samples and saves at 0, HALF and STEPS
SEEDS = 4  # samples per event (one prompt): diversity needs two; the rule reads the closest
# Every linear layer of the tiny FLUX.1 denoiser, its input and output projections included.
EVERY_LINEAR = ["x_embedder", "context_embedder", "proj_out", "norm_out.linear", "to_q", "to_k",
                "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "net.0.proj", "net.2", "proj_mlp", "norm1.linear", "norm1_context.linear",
                "norm.linear"]


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory: pytest.TempPathFactory, images: Path,
             scorer_models: tuple) -> Path:
    """A run on the red circle alone that copies it, sampled in one step at 0, HALF and STEPS
    at SEEDS seeds, with the default copy rule."""
    folder = tmp_path_factory.mktemp("copy")
    data = folder / "data"
    data.mkdir()
    for name in ("red_circle.png", "red_circle.txt"):
        shutil.copy(images / name, data / name)
    prompts = folder / "prompts.txt"
    prompts.write_text("".join(f"a red circle on a blue background --w 64 --h 64 --s 1 --d {d}\n"
                               for d in range(1, SEEDS + 1)), encoding="utf-8")
    dino, clip = scorer_models
    extra = (f'\n[metrics]\nenabled = true\ndino = "{dino.as_posix()}"\n'
             f'clip = "{clip.as_posix()}"\n')
    cfg = run_toml(folder, data, extra, steps=STEPS, prompts=prompts)
    sets = ["datasets.0.repeats=4", "train.batch_size=4", "train.lr=3e-3", "adapter.rank=32",
            "adapter.alpha=32", f"adapter.target_modules={json.dumps(EVERY_LINEAR)}",
            # clipping off: config.resolved.json holds null, which `runs rank` reads back
            "train.timesteps=shift", "train.shift=10", "train.max_grad_norm=0",
            "train.weight_decay=0", "train.betas=[0.9, 0.99]", "train.scheduler=cosine",
            "sample.guidance=1.0", f"sample.every_n_steps={HALF}",
            f"save.every_n_steps={HALF}", "save.keep_best=0.7*fidelity + 0.3*clip_score/100"]
    assert main(["train", str(cfg), "--no-progress", *[a for s in sets for a in ("--set", s)]]
                ) == 0
    return folder / "out"


def _events(out: Path) -> dict[int, dict]:
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r.get("event") == "samples"}


def test_fidelity_rises_and_the_copy_is_flagged(copy_run: Path) -> None:
    events = _events(copy_run)
    assert sorted(events) == [0, HALF, STEPS]
    assert events[STEPS]["fidelity"] > events[0]["fidelity"] + 0.3
    assert not events[0]["copying"] and events[STEPS]["copying"]  # HALF: too close to call
    assert events[STEPS]["copy_reference"] > 0.99  # the VAE copy's own floor, no override
    last = events[STEPS]["sample_metrics"]["samples"]
    assert {s["nearest"] for s in last} == {"red_circle.png"}
    assert "diversity" in events[STEPS] and "clip_score" in events[STEPS]
    log = (copy_run / "difftune.log").read_text()
    assert f"samples at step {STEPS} look copied from the training data" in log
    assert "samples at step 0 look copied" not in log
    assert "metrics: VAE copies of 1 training images ready" in log


def test_rows_equal_the_metrics_of_the_saved_samples(copy_run: Path,
                                                     scorer_models: tuple) -> None:
    dino, clip = scorer_models
    scorers = Scorers.load(MetricsConfig(enabled=True, dino=dino, clip=clip))
    training = [copy_run.parent / "data" / "red_circle.png"]
    [copy] = read_index(copy_run, training)  # the circle's VAE copy, listed by the run
    assert copy.parent == copy_run / "cache" / "vae_copies"
    ref = reference(scorers, training, copy_run / "cache", copies=[copy])
    files = sorted((copy_run / "samples").glob(f"step-{STEPS:06d}_0*.png"))
    samples = [read_sample(p) for p in files]
    assert [s.prompt for s in samples] == ["a red circle on a blue background"] * SEEDS
    again = measure(scorers, ref, samples)
    row = _events(copy_run)[STEPS]
    for key in ("fidelity", "clip_score", "diversity", "nearest_similarity", "copying",
                "copy_reference"):
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
    same = (copy_run / "lora.safetensors" if best == STEPS else
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
    assert [e.step for e in acc.Scalars("samples/fidelity")] == [0, HALF, STEPS]


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
             for s in (HALF, STEPS)}  # the steps with a LoRA (none at step 0)
    assert [c["step"] for c in ranked["checkpoints"]] == sorted(score, key=score.get,
                                                                 reverse=True)
    assert all(c["score"] == pytest.approx(score[c["step"]]) and not c["measured_now"]
               for c in ranked["checkpoints"])
    assert main(["runs", "rank", str(copy_run), "--by", "nearest_similarity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["#", "run", "step", "nearest_similarity"]
    near = {s: events[s]["nearest_similarity"] for s in (HALF, STEPS)}
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
        assert c["copying"] == events[c["step"]]["copying"]  # against the run's VAE copies


def test_check_loads_the_metric_models_and_refuses_a_broken_one(
        copy_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy_run.parent / "run.toml"
    out = ["--set", f"save.dir={(tmp_path / 'out').as_posix()}"]
    assert main(["check", str(cfg), "--no-progress", *out]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ok  metrics:"))
    floor = _events(copy_run)[STEPS]["copy_reference"]  # the run's: its VAE copy's floor
    assert f"1 training images, copy floor {floor:.4f} (a sample this similar is a copy)" in line
    broken = tmp_path / "dino"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert main(["check", str(cfg), "--no-progress", *out,
                 "--set", f"metrics.dino={broken.as_posix()}"]) == 2
    assert f"metrics.dino: {broken}" in capsys.readouterr().err
