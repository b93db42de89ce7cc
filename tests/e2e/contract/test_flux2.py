"""FLUX.2-only behaviour through the real CLI on the tiny flavors. klein (the family's default
variant, which the shared contract suite trains): block swap and gradient checkpointing train
bitwise like the plain run, a slice of the precision matrix, exact resume and disk caches with
caption augmentations, two processes against one, the LoRA layouts other trainers write read by
--init-lora, and the refusals its spec declares. dev (its own text encoder, Mistral 3): a lighter
pass, training, exact resume, and its LoRA loaded by Flux2Pipeline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig
from difftune.precision.policy import PrecisionPolicy
from difftune.report.metrics import Reporter

from ..conftest import (
    metrics_rows,
    pipeline_image,
    run_toml,
    train_cli,
    train_exit_code,
)

AUGMENT = ["datasets.0.shuffle_caption=true", "datasets.0.caption_tag_dropout_rate=0.3",
           "datasets.0.flip=true", "train.grad_accum=2", "save.every_n_steps=3"]
DEV = 'flavor = "tiny"\nvariant = "dev"'


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """A FLUX.2 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="flux2", **kw)


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
    assert "block swap: 1 of 3 denoiser blocks live in host memory" in (
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


def _resume_matches(tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
                    sets: list[str], model: str = 'flavor = "tiny"') -> None:
    """A run stopped at step 3 and resumed equals an uninterrupted one, bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = run_toml(tmp_path / "a", images, steps=6, family="flux2", model=model)
    b = run_toml(tmp_path / "b", images, steps=6, family="flux2", model=model)
    assert train_exit_code(a, *sets) == 0
    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)
        if s == 3:
            os.kill(os.getpid(), signal.SIGINT)

    with monkeypatch.context() as mp:
        mp.setattr(Reporter, "step", reporting)
        assert train_exit_code(b, *sets) == 0
    assert train_exit_code(b, *sets, extra=["--resume", "latest"]) == 0
    rows = [[(r["step"], r["loss"]) for r in map(json.loads, (p / "out" / "metrics.jsonl")
                                                 .read_text().splitlines())]
            for p in (tmp_path / "a", tmp_path / "b")]
    assert rows[0] == rows[1]
    assert_same(tmp_path / "a" / "out", tmp_path / "b" / "out")


def test_stopped_and_resumed_run_equals_an_uninterrupted_one(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _resume_matches(tmp_path, images, monkeypatch, AUGMENT)


@pytest.mark.parametrize("sets, message", [
    (['adapter.text_encoders=["qwen3"]'], "'qwen3' of model.family = \"flux2\" cannot get a LoRA"),
    (['model.variant="schnell"'], "is not a variant of model.family = \"flux2\""),
])
def test_refusals(sets: list[str], message: str, tmp_path: Path, images: Path,
                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="flux2")
    assert main(["train", str(cfg), "--no-progress", *[x for s in sets for x in ("--set", s)]]
                ) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_embeddings_refused(tmp_path: Path, images: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="flux2")
    cfg.write_text(cfg.read_text().replace(
        "[[datasets]]", '[[adapter.embeddings]]\nname = "<sks>"\ninit = "a dog"\n\n[[datasets]]',
        1))
    assert main(["check", str(cfg)]) == 2
    assert "textual inversion is not supported" in capsys.readouterr().err


def test_init_lora_reads_the_other_trainers_layouts(trained: Callable[[str], Path],
                                                    images: Path, tmp_path: Path) -> None:
    """Our diffusers file, ai-toolkit's `diffusion_model.` PEFT names without alpha, and the
    kohya `lora_unet_` layout (BFL names, fused qkv) of the same LoRA start the same run."""
    ours = trained("flux2") / "lora.safetensors"
    tensors = load_file(str(ours))
    ai_toolkit = tmp_path / "ai_toolkit.safetensors"
    save_file({k.replace("transformer.", "diffusion_model.", 1): v for k, v in tensors.items()},
              str(ai_toolkit))
    family = families.get("flux2")
    kohya = tmp_path / "kohya.safetensors"
    save_file(family.lora_to_format(None, tensors, "kohya", 4, 4.0), str(kohya))
    losses = []
    for name, init in (("ours", ours), ("ai_toolkit", ai_toolkit), ("kohya", kohya),
                       ("fresh", None)):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="flux2")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses.append(metrics_rows(tmp_path / name / "out")[0]["loss"])
    assert losses[0] == losses[1] != losses[3]
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)  # fused and split back: rounding


def test_disk_cache_with_caption_augmentations(images: Path, tmp_path: Path) -> None:
    """Caption-augmented runs read back from disk train exactly as with the memory cache, the
    second disk run reading what the first wrote."""
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
    one = run_toml(tmp_path / "one", images, steps=2, family="flux2")
    assert train_exit_code(one) == 0
    two = run_toml(tmp_path / "two", images, steps=2, family="flux2")
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


def test_dev_trains_resumes_and_its_lora_loads_in_flux2_pipeline(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dev's tiny flavor (Mistral 3 encoder, guidance embedding): exact resume, and the saved
    diffusers file loads in Flux2Pipeline with every tensor used and the output changed."""
    _resume_matches(tmp_path, images, monkeypatch, [], model=DEV)
    check = run_toml(tmp_path / "check", images, family="flux2", model=DEV)
    assert main(["check", str(check)]) == 0
    family = families.get("flux2", "dev")
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = family.pipeline(family.load(ModelConfig(family="flux2", flavor="tiny", variant="dev"),
                                       policy))
    assert type(pipe).__name__ == "Flux2Pipeline"
    before = pipeline_image(pipe, guidance_scale=2.0)
    file = tmp_path / "a" / "out" / "lora.safetensors"
    pipe.load_lora_weights(str(file))
    assert not torch.allclose(before, pipeline_image(pipe, guidance_scale=2.0), atol=1e-4)
    from peft import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert {f"transformer.{k}" for k in loaded} == set(load_file(str(file)))
