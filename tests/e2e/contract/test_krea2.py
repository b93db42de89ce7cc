"""Krea 2-only behaviour through the real CLI on the tiny flavor: block swap and gradient
checkpointing train bitwise like the plain run, a slice of the precision matrix (bf16 with fp8
storage, fp16 with int8 quantization), exact resume and disk caches with caption augmentations
(cached fixed-length stacked text embeddings with masks), two processes against one, the
refusals its spec declares."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main
from difftune.report.metrics import Reporter

from ..conftest import metrics_rows, run_toml, train_cli, train_exit_code

AUGMENT = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3",
           "datasets.0.flip=true", "train.grad_accum=2", "save.every_n_steps=3"]


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """A Krea 2 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="krea2", **kw)


def outputs(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A run's losses and its saved LoRA."""
    return [r["loss"] for r in metrics_rows(out)], load_file(str(out / "lora.safetensors"))


def assert_same(a: Path, b: Path) -> None:
    """Bitwise equal losses and LoRA tensors."""
    (la, wa), (lb, wb) = outputs(a), outputs(b)
    assert la == lb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_block_swap_and_checkpointing_train_like_the_plain_run(images: Path,
                                                              tmp_path: Path) -> None:
    plain = train(tmp_path / "plain", images, steps=2)
    ckpt = train(tmp_path / "ckpt", images, "train.gradient_checkpointing=true", steps=2)
    swap = train(tmp_path / "swap", images, "train.gradient_checkpointing=true",
                 "train.blocks_to_swap=1", steps=2)
    assert_same(plain, ckpt)
    assert_same(plain, swap)
    assert "block swap: 1 of 2 denoiser blocks live in host memory" in (
        swap / "difftune.log").read_text()


@pytest.mark.parametrize("sets", [
    ('precision.mixed="bf16"', 'precision.denoiser="fp8"', 'precision.text_encoders="fp8"'),
    ('precision.mixed="fp16"', 'precision.quantize.denoiser="int8"'),
], ids=["bf16-fp8", "fp16-int8"])
def test_precision_slice(sets: tuple[str, ...], images: Path, tmp_path: Path) -> None:
    out = train(tmp_path, images, *sets, 'adapter.targets="attention"', steps=2)
    losses, lora = outputs(out)
    assert len(losses) == 2 and all(0 < x < 100 for x in losses)
    assert lora and all(v.dtype == torch.float32 and torch.isfinite(v).all()
                        for v in lora.values())


def test_stopped_and_resumed_run_equals_an_uninterrupted_one(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = run_toml(tmp_path / "a", images, steps=6, family="krea2")
    b = run_toml(tmp_path / "b", images, steps=6, family="krea2")
    assert train_exit_code(a, *AUGMENT) == 0
    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)
        if s == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as mp:
        mp.setattr(Reporter, "step", reporting)
        assert train_exit_code(b, *AUGMENT) == 0
    assert train_exit_code(b, *AUGMENT, extra=["--resume", "latest"]) == 0
    rows = [[(r["step"], r["loss"]) for r in map(json.loads, (p / "out" / "metrics.jsonl")
                                                 .read_text().splitlines())]
            for p in (tmp_path / "a", tmp_path / "b")]
    assert rows[0] == rows[1]
    assert_same(tmp_path / "a" / "out", tmp_path / "b" / "out")


@pytest.mark.parametrize("sets, message", [
    (['adapter.text_encoders=["qwen3vl"]'], "'qwen3vl' of model.family = \"krea2\" cannot get a LoRA"),
])
def test_refusals(sets: list[str], message: str, tmp_path: Path, images: Path,
                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="krea2")
    assert main(["train", str(cfg), "--no-progress", *[x for s in sets for x in ("--set", s)]]
                ) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_embeddings_refused(tmp_path: Path, images: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="krea2")
    cfg.write_text(cfg.read_text().replace(
        "[[datasets]]", '[[adapter.embeddings]]\nname = "<sks>"\ninit = "a dog"\n\n[[datasets]]',
        1))
    assert main(["check", str(cfg)]) == 2
    assert "textual inversion is not supported" in capsys.readouterr().err


def test_disk_cache_of_stacked_embeddings(images: Path, tmp_path: Path) -> None:
    """Caption-augmented runs read back from disk (fixed-length stacked entries with masks)
    train exactly as with the memory cache, the second disk run reading what the first wrote."""
    sets = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3"]
    disk = [*sets, 'cache.text="disk"', 'cache.latents="disk"',
            f'cache.dir="{(tmp_path / "cache").as_posix()}"']
    memory = train(tmp_path / "memory", images, *sets, steps=3)
    first = train(tmp_path / "first", images, *disk, steps=3)
    entries = sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file())
    second = train(tmp_path / "second", images, *disk, steps=3)
    assert entries and entries == sorted(p.name for p in (tmp_path / "cache").rglob("*")
                                         if p.is_file())
    assert_same(memory, first)
    assert_same(memory, second)


def test_two_processes_match_one_with_the_same_global_batch(images: Path, tmp_path: Path) -> None:
    """Two processes of batch 1 (accelerate launch, gloo, disk caches shared between them) train
    as one process of batch 2 does."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_toml(tmp_path / "one", images, steps=2, family="krea2")
    assert train_exit_code(one) == 0
    two = run_toml(tmp_path / "two", images, steps=2, family="krea2")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
           "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", "-m", "difftune", "train", str(two), "--no-progress",
           "--set", "train.batch_size=1", "--set", 'cache.text="disk"',
           "--set", 'cache.latents="disk"']
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (la, wa), (lb, wb) = outputs(tmp_path / "one" / "out"), outputs(tmp_path / "two" / "out")
    assert la == pytest.approx(lb, rel=1e-5)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 0.1 * 1e-2  # 0.1 x lr


def _layouts(ours: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Our diffusers-layout file (scale folded in: alpha = rank) as other trainers write it."""
    from difftune.families.krea2.keys import to_original

    original = to_original(ours, rank=4, alpha=4.0)
    kohya: dict[str, torch.Tensor] = {}
    for key, value in original.items():
        module = "lora_unet_" + key.removeprefix("diffusion_model.").rsplit(".lora_", 1)[0] \
            .replace(".", "_")
        if key.endswith(".lora_A.weight"):
            kohya[f"{module}.lora_down.weight"] = value
            kohya[f"{module}.alpha"] = torch.tensor(8.0)  # scale 8 / 4: the up factor halved
        else:
            kohya[f"{module}.lora_up.weight"] = value / 2
    return {
        "original": original,
        "ai_toolkit": {k.replace("diffusion_model.", "base_model.model.", 1): v
                       for k, v in original.items()},
        "kohya": kohya,
        "comfy_diffusers": {k.replace("transformer.", "diffusion_model.", 1): v
                            for k, v in ours.items()},
    }


def test_init_lora_reads_other_trainers_layouts(trained: Callable[[str], Path], images: Path,
                                               tmp_path: Path) -> None:
    """Starting from another trainer's copy of our LoRA (the original names with
    `diffusion_model.`, ai-toolkit's `base_model.model.` without alpha, kohya `lora_unet_` with
    alpha, diffusers names under `diffusion_model.`) is starting from our file."""
    ours = trained("krea2") / "lora.safetensors"
    files = {"ours": ours}
    for name, tensors in _layouts(load_file(str(ours))).items():
        files[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(files[name]))
    losses = {}
    for name, init in [*files.items(), ("fresh", None)]:
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="krea2")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses[name] = metrics_rows(tmp_path / name / "out")[0]["loss"]
    fresh = losses.pop("fresh")
    assert all(v == pytest.approx(losses["ours"], rel=1e-6) for v in losses.values()), losses
    assert fresh != losses["ours"]


def test_original_layout_loads_in_diffusers_like_the_diffusers_one(
        trained: Callable[[str], Path], images: Path, tmp_path: Path) -> None:
    """save.format = "kohya" writes the original layout
    (`diffusion_model.blocks.N.attn.wq`); Krea2Pipeline.load_lora_weights converts it and samples
    what the diffusers file gives, and --init-lora reads it as the diffusers file."""
    from ..conftest import pipeline_image, tiny_pipeline

    out = train(tmp_path / "orig", images, 'save.format="kohya"', steps=2)
    tensors = load_file(str(out / "lora.safetensors"))
    assert tensors and all(k.startswith("diffusion_model.") and ".lora_" in k for k in tensors)
    assert any(".attn.wq.lora_A" in k for k in tensors)
    twin = train(tmp_path / "diff", images, steps=2)
    images_ = []
    for path in (out, twin):
        pipe = tiny_pipeline("krea2")
        pipe.load_lora_weights(str(path / "lora.safetensors"))
        images_.append(pipeline_image(pipe))
    torch.testing.assert_close(images_[0], images_[1], rtol=0, atol=1e-5)
    # Our original-layout file (scale folded, metadata alpha 8) starts a run as the diffusers one.
    losses = []
    for name, path in (("from_orig", out), ("from_diff", twin)):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="krea2")
        assert train_exit_code(cfg, extra=["--init-lora", str(path / "lora.safetensors")]) == 0
        losses.append(metrics_rows(tmp_path / name / "out")[0]["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
