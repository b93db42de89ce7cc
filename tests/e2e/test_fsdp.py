"""Sharded full fine-tuning (`train.distributed = "fsdp"`) through the real CLI: two processes
on the CPU (gloo, launched by accelerate) against one, and sharded checkpoints resumed on
another number of processes.

Tolerance: 2 processes with train.batch_size 1 draw the same noise, timesteps and batches as
one process with batch 2 (see test_distributed.py); they differ only in floating-point
summation order (per-process means, FSDP's reduce-scatter of the gradients, the norm of the
sharded gradients summed over processes). The runs clip every step (max_grad_norm 0.01, far
below the tiny model's gradient norm) with AdamW at eps = 1: Adam then steps along the clipped
gradient itself (lr x m / (sqrt(v) + 1), about lr x gradient, as SGD) instead of its sign, so a
weight moves at most lr x max_grad_norm a step, a wrong clipping norm changes each update by
percents, and summation-order noise is not amplified by dividing near-zero moments. We require
per-step losses equal to a relative 1e-5 and every written weight within 1e-3 x lr x
max_grad_norm. Seen here: 4e-9 for a correct run; 6e-4 (and losses off by 1e-2) when each
process clipped with the norm of its own shard, and about as much with no clipping at all.

The runs use gradient checkpointing (FSDP2 and diffusers' checkpointing together) and an EMA
(sharded like the weights), from which the compared files are written.

The two-process run also measures a validation loss that picks the best step (save.keep_best):
every process must join each candidate's save, which gathers the whole weights.

Tiers: the two-process run is one module fixture that the default tests read; every other
test launches its own two processes and is `full_only`: the 1 -> 2 resume, a short batch that
leaves one process without rows, a NaN loss on one process only, a stop signal to one
process, and bf16 compute with bf16 frozen weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import CheckpointError
from difftune.train.checkpoint import CheckpointManager, manager
from difftune.train.checkpoint.files import read
from difftune.train.dist import Dist
from tests.e2e.conftest import metrics_rows, run_toml
from tests.e2e.test_distributed import (ROOT, five_images, held_out, launch, losses,
                                        stop_one_process)

LR, NORM = 1.0, 0.01
FULL = 'type = "full"\ntrain_blocks = ["transformer_blocks.*", "proj_out"]\n'
SETS = ["--set", 'train.distributed="fsdp"', "--set", f"train.lr={LR}", "--set", "train.eps=1",
        "--set", f"train.max_grad_norm={NORM}", "--set", "train.weight_decay=0",
        "--set", "save.every_n_steps=2", "--set", "train.gradient_checkpointing=true",
        "--set", "train.ema.enabled=true", "--set", "train.ema.decay=0.5"]
WEIGHTS = Path("lora") / "transformer" / "diffusion_pytorch_model.safetensors"


def config(folder: Path, images: Path) -> Path:
    """The shared tiny run, as a full fine-tune of some blocks of the tiny FLUX.1."""
    cfg = run_toml(folder, images, steps=4, fmt=None)
    text = cfg.read_text().replace('rank = 4\nalpha = 8\ntargets = "all_linear"\n', FULL)
    assert 'type = "full"' in text
    cfg.write_text(text)
    return cfg


def assert_same_model(a: Path, b: Path) -> None:
    """The two runs' written models (diffusers folders) agree to 1e-3 x lr x max_grad_norm."""
    wa, wb = load_file(str(a / WEIGHTS)), load_file(str(b / WEIGHTS))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-3 * LR * NORM


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A 4-step FSDP full fine-tune with 2 processes of batch 1 (checkpoints at 2 and 4),
    whose validation loss (on a folder of its own, so training reads the same data as the
    one-process runs) picks the best step (save.keep_best) at 2 and 4."""
    folder = tmp_path_factory.mktemp("fsdp")
    cfg = config(folder, images)
    cfg.write_text(cfg.read_text() + held_out(folder, images) + "every_n_steps = 2\n")
    done = launch(["-m", "difftune", "train", str(cfg), "--no-progress", *SETS,
                   "--set", "train.batch_size=1", "--set", "save.keep_best=val_loss"])
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "out"


def test_two_sharded_processes_match_one(tmp_path: Path, images: Path, sharded: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    log = (sharded / "difftune.log").read_text()
    assert "sharded (FSDP) run: 2 processes, global batch 2" in log
    assert "FSDP: the denoiser is sharded over 2 processes" in log
    ckpt = sharded / "checkpoints" / "step-000002"
    shards = sorted(p.name for p in (ckpt / "sharded").iterdir())
    assert len(shards) == 2 and all(s.endswith(".safetensors") for s in shards)  # one a rank
    assert not (ckpt / "trainable.safetensors").exists()
    saved = read(ckpt)  # headers only: every trained weight with its whole shape
    assert saved.sharded is not None and "transformer.proj_out.weight" in saved.trainable
    assert saved.ema is not None and saved.ema.keys() == saved.trainable.keys()
    assert all(k.startswith(("transformer.transformer_blocks.", "transformer.proj_out"))
               for k in saved.trainable)
    one = config(tmp_path, images)  # one process, batch 2, no sharding
    assert main(["train", str(one), "--no-progress", *SETS[2:]]) == 0
    assert losses(sharded) == pytest.approx(losses(tmp_path / "out"), rel=1e-5)
    assert_same_model(sharded, tmp_path / "out")
    # Written by rank 0 from the gathered weights: the model's own class, and the single file.
    config_doc = json.loads((sharded / WEIGHTS.parent / "config.json").read_text())
    assert config_doc["_class_name"] == "FluxTransformer2DModel"
    fa, fb = (load_file(str(out / "lora.safetensors")) for out in (sharded, tmp_path / "out"))
    assert fa.keys() == fb.keys()
    assert max(float((fa[k] - fb[k]).abs().max()) for k in fa) <= 1e-3 * LR * NORM
    # Its checkpoints are not sharded: a sharded run of several processes refuses them at
    # once, before the model loads, naming the fix.
    monkeypatch.setattr(manager, "current", lambda: Dist(0, 2))
    with pytest.raises(CheckpointError, match="resumes only sharded checkpoints"):
        CheckpointManager.open(load_config(one, [a.removeprefix("--set ") for a in SETS
                                                 if a != "--set"]),
                               str(tmp_path / "out" / "checkpoints" / "step-000002"))


def test_keep_best_in_a_sharded_run_keeps_the_step_of_lowest_validation_loss(
        sharded: Path) -> None:
    """Every process joins each candidate's save (it gathers the whole weights), rank 0 alone
    judges. Seen before: rank 0 gathered alone at the first evaluation and the run hung."""
    val = {r["step"]: r["val_loss"] for r in metrics_rows(sharded) if "val_loss" in r}
    assert sorted(val) == [2, 4]
    best = min(val, key=val.__getitem__)
    record = json.loads((sharded / "best.json").read_text())
    assert record["best_step"] == best and record["scores"].keys() == {"2", "4"}
    kept = load_file(str(sharded / "lora-best.safetensors"))
    step = load_file(str(sharded / ("lora.safetensors" if best == 4
                                    else "lora-step000002.safetensors")))
    assert kept.keys() == step.keys() and all(torch.equal(kept[k], step[k]) for k in kept)
    assert not (sharded / ".best-candidates").exists()


def test_a_two_process_checkpoint_resumes_in_one(tmp_path: Path, images: Path,
                                                 sharded: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(sharded / "checkpoints" / "step-000002", out / "checkpoints" / "step-000002")
    cfg = config(tmp_path, images)
    assert main(["train", str(cfg), "--no-progress", *SETS, "--resume", "latest"]) == 0
    assert losses(out) == pytest.approx(losses(sharded)[2:], rel=1e-5)
    assert_same_model(sharded, out)
    a, b = read(sharded / "checkpoints" / "step-000004"), read(out / "checkpoints" / "step-000004")
    assert a.trainable.keys() == b.trainable.keys() and b.sharded is not None


@pytest.mark.full_only
def test_a_one_process_checkpoint_resumes_on_two(tmp_path: Path, images: Path) -> None:
    (tmp_path / "one").mkdir()
    one = config(tmp_path / "one", images)
    assert main(["train", str(one), "--no-progress", *SETS]) == 0
    out = tmp_path / "two" / "out"
    shutil.copytree(tmp_path / "one" / "out" / "checkpoints" / "step-000002",
                    out / "checkpoints" / "step-000002")
    two = config(tmp_path / "two", images)
    done = launch(["-m", "difftune", "train", str(two), "--no-progress", *SETS,
                   "--set", "train.batch_size=1", "--resume", "latest"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(out) == pytest.approx(losses(tmp_path / "one" / "out")[2:], rel=1e-5)
    assert_same_model(tmp_path / "one" / "out", out)


@pytest.mark.full_only
def test_a_short_batch_leaving_one_process_empty_still_matches(tmp_path: Path,
                                                               images: Path) -> None:
    five = five_images(tmp_path, images)
    # Global batch 2: batches of 2, 2 and 1; on a batch of 1 rank 0 has no row and joins
    # rank 1's forward and backward with that row weighted 0 (FSDP needs every process there;
    # seen: 3 such micro-batches in this run).
    (tmp_path / "one").mkdir()
    assert main(["train", str(config(tmp_path / "one", five)), "--no-progress", *SETS[2:],
                 "--set", "train.grad_accum=2"]) == 0
    done = launch(["-m", "difftune", "train", str(config(tmp_path / "two", five)),
                   "--no-progress", *SETS, "--set", "train.batch_size=1",
                   "--set", "train.grad_accum=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert losses(tmp_path / "two" / "out") == pytest.approx(losses(tmp_path / "one" / "out"),
                                                             rel=1e-5)
    assert_same_model(tmp_path / "two" / "out", tmp_path / "one" / "out")


@pytest.mark.full_only
def test_a_nan_loss_on_one_process_skips_the_step_on_all(tmp_path: Path, images: Path) -> None:
    done = launch([str(ROOT / "tests" / "e2e" / "nan_rank.py"), "train",
                   str(config(tmp_path, images)), "--no-progress", *SETS,
                   "--set", "train.batch_size=1"], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]  # finished, not hung in a collective
    rows = metrics_rows(tmp_path / "out")
    assert [r["skipped_nonfinite"] for r in rows] == [0, 1, 1, 1]
    weights = load_file(str(tmp_path / "out" / WEIGHTS))
    assert all(bool(v.isfinite().all()) for v in weights.values())  # the NaN reached no weight


@pytest.mark.full_only
def test_bf16_compute_and_bf16_frozen_weights_match_one_process(tmp_path: Path,
                                                                images: Path) -> None:
    # FSDP gathers the weights in bf16 for every op (MixedPrecisionPolicy, which also lets
    # fp32 trained and bf16 frozen weights share a block); one process under autocast casts
    # only the inputs of matmuls: hence 10x the fp32 tolerance (seen: 4e-6 in the weights,
    # 2e-5 relative in the losses).
    bf16 = ["--set", 'precision.mixed="bf16"', "--set", 'precision.denoiser="bf16"']
    (tmp_path / "one").mkdir()
    assert main(["train", str(config(tmp_path / "one", images)), "--no-progress", *SETS[2:],
                 *bf16]) == 0
    done = launch(["-m", "difftune", "train", str(config(tmp_path / "two", images)),
                   "--no-progress", *SETS, *bf16, "--set", "train.batch_size=1"])
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = tmp_path / "two" / "out", tmp_path / "one" / "out"
    assert losses(a) == pytest.approx(losses(b), rel=1e-4)
    wa, wb = load_file(str(a / WEIGHTS)), load_file(str(b / WEIGHTS))
    assert max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa) <= 1e-2 * LR * NORM


@pytest.mark.full_only
def test_a_stop_signal_to_one_sharded_process_stops_both_with_one_checkpoint(
        tmp_path: Path, images: Path) -> None:
    """Both join the sharded checkpoint's save after the same step (no hang: checked)."""
    cfg = config(tmp_path, images)
    cfg.write_text(cfg.read_text().replace("steps = 4", "steps = 200", 1))
    stop_one_process(cfg, tmp_path / "out", [*SETS, "--set", "train.batch_size=1",
                                             "--set", "save.every_n_steps=100"])
    (saved,) = (tmp_path / "out" / "checkpoints").iterdir()
    assert len(list((saved / "sharded").glob("*.safetensors"))) == 2  # one a process
