"""Memory savers through the real CLI on the tiny flavor (CPU): each trains to the same
result as the run without it, and the combinations that cannot work are refused in seconds.

What they save is measured on a GPU by bench/speed.py (docs/performance.md); here the host and
the device are one memory, so these tests hold the arithmetic and the plumbing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import ConfigError
from difftune.families import get
from difftune.memory import estimate, savers

from .conftest import run_toml, train_cli

NO_CLIP = "train.max_grad_norm=1e9"  # clipping by a global norm and per tensor agree: never


def train(folder: Path, images: Path, *sets: str, prompts: Path | None = None) -> Path:
    """A 4-step run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, steps=4, prompts=prompts)


def result(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows], load_file(str(out / "lora.safetensors"))


def assert_same(a: Path, b: Path) -> None:
    (la, wa), (lb, wb) = result(a), result(b)
    assert la == lb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_block_swap_trains_and_samples_like_the_run_without(tmp_path: Path, images: Path,
                                                            prompts: Path) -> None:
    ckpt = "train.gradient_checkpointing=true"
    plain = train(tmp_path / "plain", images, ckpt, prompts=prompts)
    swapped = train(tmp_path / "swap", images, ckpt, "train.blocks_to_swap=3", prompts=prompts)
    assert_same(plain, swapped)
    names = sorted(p.name for p in (swapped / "samples").rglob("*.png"))
    assert names and names == sorted(p.name for p in (plain / "samples").rglob("*.png"))
    log = (swapped / "difftune.log").read_text()
    assert "block swap: 3 of 4 denoiser blocks live in host memory" in log


def test_fused_backward_trains_like_adamw(tmp_path: Path, images: Path) -> None:
    plain = train(tmp_path / "plain", images, NO_CLIP)
    fused = train(tmp_path / "fused", images, NO_CLIP, "train.fused_backward=true")
    assert_same(plain, fused)


def test_fused_backward_run_resumes_exactly(tmp_path: Path, images: Path) -> None:
    sets = [NO_CLIP, "train.fused_backward=true", "save.every_n_steps=2"]
    whole = train(tmp_path / "whole", images, *sets)
    (tmp_path / "part").mkdir()
    cfg = run_toml(tmp_path / "part", images, steps=4)
    args = ["train", str(cfg), "--no-progress", *[a for s in sets for a in ("--set", s)]]
    assert main(args + ["--set", "train.steps=2"]) == 0
    (tmp_path / "part" / "out" / "lora.safetensors").unlink()  # the 2-step run's final file
    assert main(args + ["--resume", "latest"]) == 0
    assert result(whole)[1].keys() == result(tmp_path / "part" / "out")[1].keys()
    wa, wb = result(whole)[1], result(tmp_path / "part" / "out")[1]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.full_only  # inductor's CPU compile alone is ~30 s; the GPU suite runs it on CUDA
def test_compiled_blocks_train_like_eager_ones(tmp_path: Path, images: Path,
                                              finished: Path) -> None:
    """Compiled blocks give the eager run's losses and LoRA (the wiring, which blocks get
    compiled, is in the default run: test_compile_wraps_the_spec_blocks_without_running_them)."""
    eager = finished.parent / "out"  # the shared 4-step eager run (its checkpoints change nothing)
    compiled = train(tmp_path / "compiled", images, "train.compile=true")
    (le, we), (lc, wc) = result(eager), result(compiled)
    assert lc == pytest.approx(le, rel=1e-4)
    assert max(float((we[k] - wc[k]).abs().max()) for k in we) <= 1e-3  # 0.1 x lr
    assert "torch.compile: 4 denoiser blocks" in (compiled / "difftune.log").read_text()


def test_compile_wraps_the_spec_blocks_without_running_them(tmp_path: Path,
                                                           images: Path) -> None:
    """`train.compile` compiles each of the family's `compile_blocks` (lazily: nothing runs)."""
    from difftune import families
    from difftune.config import load_config
    from difftune.families.base import blocks_of
    from difftune.memory import savers
    from tests.unit.test_blockswap import build

    cfg = load_config(run_toml(tmp_path, images), ["train.compile=true"])
    family = families.get(cfg.model.family, cfg.model.variant)
    denoiser = build()  # the tiny FLUX.1 transformer, the run's family
    savers.apply(cfg, family, denoiser, torch.device("cpu"))
    blocks = blocks_of(denoiser, family.compile_blocks)
    assert blocks and all(b._compiled_call_impl is not None for b in blocks)
    others = [m for m in denoiser.modules() if m not in blocks and m is not denoiser]
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in others)


@pytest.mark.parametrize("sets, message", [
    (['train.optimizer="adamw8bit"'], "runs on CUDA only"),
    (["train.fused_backward=true", "train.grad_accum=2"], "cannot accumulate"),
    (["train.fused_backward=true", 'precision.mixed="fp16"'], "loss scaler"),
    (["train.fused_backward=true", 'train.optimizer="adamw8bit"'], "choose one"),
    (["train.blocks_to_swap=2", "train.compile=true"], "choose one of the two"),
    (["train.blocks_to_swap=4"], "swap at most 3"),
])
def test_impossible_savers_are_refused_by_check(tmp_path: Path, images: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                sets: list[str], message: str) -> None:
    cfg = run_toml(tmp_path, images)
    assert main(["check", str(cfg), *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_eight_bit_optimizer_on_a_cpu_picked_by_auto_is_refused(tmp_path: Path, images: Path,
                                                                capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPU here")
    cfg = run_toml(tmp_path, images)
    assert main(["check", str(cfg), "--set", 'train.device="auto"',
                 "--set", 'train.optimizer="adamw8bit"']) == 2
    assert "runs on CUDA only" in capsys.readouterr().err


def test_fused_backward_and_block_swap_refusals_known_at_start(tmp_path: Path,
                                                               images: Path) -> None:
    cfg = load_config(run_toml(tmp_path, images), ["train.fused_backward=true"])
    with pytest.raises(ConfigError, match=r"train\.fused_backward .*nothing left to average .*"
                       r"\(this one has 2\)"):
        savers.check(cfg, get("flux"), torch.device("cpu"), world=2)
    sdxl = load_config(run_toml(tmp_path, images), ["train.blocks_to_swap=2"])
    with pytest.raises(ConfigError,
                       match=r"train\.blocks_to_swap: the sdxl family cannot swap blocks"):
        savers.check(sdxl, get("sdxl"), torch.device("cpu"), world=1)


def test_check_names_the_savers_in_use(tmp_path: Path, images: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    assert main(["check", str(cfg), "--set", "train.gradient_checkpointing=true",
                 "--set", "train.blocks_to_swap=2", "--set", "train.fused_backward=true"]) == 0
    out = capsys.readouterr().out
    assert ("memory savers: gradient checkpointing, block swap (2 of 4 blocks in host memory), "
            "fused backward") in out
    # The estimate for the loaded (tiny) model, labelled as one, with what each card needs.
    line = next(ln for ln in out.splitlines() if "estimated peak:" in ln)
    assert re.search(r"estimated peak: [\d.]+ GiB on the GPU, while .*at 64x64 batch 2", line)
    assert estimate.LABEL in line and "fits 24 GiB as it is; 16 GiB as it is" in line
    assert line.endswith("(sizes: the loaded model)")
