"""Full fine-tuning and EMA through the real CLI on the tiny FLUX.1: exact resume with sharded
checkpoints (weights, optimizer, EMA), trained blocks only, samples and files from the EMA, the
diffusers folder (read by `from_pretrained`) and the BFL single file (read through diffusers'
converter), a fully trained text encoder, and an EMA of a LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel

from difftune.sample.runner import SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.files import read
from difftune.families.flux.files import load_transformer_file
from tests.e2e.conftest import (copy_run, metrics_rows, run_toml, stopped_and_resumed,
                                tiny_pipeline, train_exit_code)

FULL = '\n[adapter]\ntype = "full"\ntrain_blocks = ["transformer_blocks.*", "proj_out"]\n'


def _config(folder: Path, images: Path, steps: int = 4, prompts: Path | None = None) -> Path:
    """The shared tiny run file, turned into a full fine-tune of some blocks."""
    cfg = run_toml(folder, images, steps=steps, fmt=None, prompts=prompts)
    text = cfg.read_text().replace("[adapter]\nrank = 4\nalpha = 8\ntargets = \"all_linear\"\n",
                                   FULL.lstrip("\n"))
    assert text != cfg.read_text()
    cfg.write_text(text)
    return cfg


def test_full_finetune_with_ema_resumes_exactly_and_writes_loadable_files(
        tmp_path: Path, images: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small shards, so the weights and the optimizer state are written as several files.
    monkeypatch.setattr(CheckpointManager, "shard_bytes", 48 << 10)
    seen: dict[tuple[str, int], torch.Tensor] = {}

    def sample(self: SampleRunner, step: int, *args: object, **kw: object) -> list[Path]:
        """What the samples would be drawn with: the trained proj_out weight at that step."""
        seen[(str(self.out_dir), step)] = self.comps.denoiser.proj_out.weight.detach().clone()
        return []

    monkeypatch.setattr(SampleRunner, "run", sample)
    a, b = (_config(tmp_path / n, images, prompts=prompts) for n in ("a", "b"))
    sets = ("train.gradient_checkpointing=true", "save.every_n_steps=2", "train.lr=1e-3",
            "train.ema.enabled=true", "train.ema.decay=0.5", 'train.ema.use_for=["saves","samples"]')
    ra, rb = stopped_and_resumed(a, b, monkeypatch, 2, *sets)
    assert ra == rb  # bitwise equal losses
    ckpt = sorted((tmp_path / "b" / "out" / "checkpoints").iterdir())[-1]
    assert (ckpt / "trainable.safetensors.index.json").is_file()
    assert (ckpt / "optimizer.safetensors.index.json").is_file()
    assert len(list(ckpt.glob("trainable-*.safetensors"))) > 1
    saved = read(ckpt)
    uninterrupted = read(tmp_path / "a" / "out" / "checkpoints" / ckpt.name)
    for part in ("trainable", "ema", "optimizer"):  # bit for bit, each tensor
        mine, theirs = getattr(saved, part), getattr(uninterrupted, part)
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert saved.ema is not None and saved.ema.keys() == saved.trainable.keys()
    assert not torch.equal(saved.ema["transformer.proj_out.weight"],
                           saved.trainable["transformer.proj_out.weight"])
    # Samples (steps 2 and 4 of the resumed run b) were drawn with the EMA weights.
    b_samples = str(tmp_path / "b" / "out" / "samples")
    step2 = read(tmp_path / "b" / "out" / "checkpoints" / "step-000002").ema
    assert torch.equal(seen[(b_samples, 2)], step2["transformer.proj_out.weight"])
    assert torch.equal(seen[(b_samples, 4)], saved.ema["transformer.proj_out.weight"])
    state = saved.ema  # the files are written from the EMA (use_for saves)
    assert state and all(k.startswith(("transformer.transformer_blocks.", "transformer.proj_out"))
                         for k in state)
    for run in ("a", "b"):
        model = FluxTransformer2DModel.from_pretrained(tmp_path / run / "out" / "lora"
                                                       / "transformer")
        loaded = model.state_dict()
        for key, value in state.items():
            assert torch.equal(loaded[key.removeprefix("transformer.")], value), key
    # The BFL single file (what ComfyUI and Forge load), read through diffusers' converter.
    single = load_transformer_file(tmp_path / "b" / "out" / "lora.safetensors",
                                   torch.float32).state_dict()
    base = tiny_pipeline("flux").transformer.state_dict()
    for key, value in single.items():  # trained weights from the EMA, the rest the base's
        assert torch.equal(value, state.get(f"transformer.{key}", base[key])), key
    assert metrics_rows(tmp_path / "b" / "out")[-1]["step"] == 4


def test_resume_with_ema_from_a_run_without_is_refused(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = copy_run(finished, tmp_path / "run")
    code = train_exit_code(cfg, "train.steps=6", "train.ema.enabled=true",
                           extra=["--resume", "latest"])
    assert code == 2
    assert "holds no EMA" in capsys.readouterr().err


def test_full_text_encoder_with_fused_backward(tmp_path: Path, images: Path) -> None:
    """adapter.text_encoders with type "full": the encoder's own weights train (fused backward
    steps every tensor inside backward), and it is written as a transformers model folder."""
    from transformers import CLIPTextModel

    cfg = _config(tmp_path, images, steps=2)
    cfg.write_text(cfg.read_text().replace('train_blocks = ["transformer_blocks.*", "proj_out"]',
                                           'train_blocks = ["proj_out"]\ntext_encoders = ["clip_l"]'))
    assert train_exit_code(cfg, "train.fused_backward=true") == 0
    ckpt = read(sorted((tmp_path / "out" / "checkpoints").iterdir())[-1]).trainable
    clip = {k.removeprefix("text_encoder."): v for k, v in ckpt.items()
            if k.startswith("text_encoder.")}
    assert clip and {k for k in ckpt if k.startswith("transformer.")} == {
        "transformer.proj_out.weight", "transformer.proj_out.bias"}
    saved = CLIPTextModel.from_pretrained(tmp_path / "out" / "lora" / "text_encoder").state_dict()
    base = tiny_pipeline("flux").text_encoder.state_dict()
    assert all(torch.equal(saved[k], v) for k, v in clip.items())
    assert any(not torch.equal(base[k], v) for k, v in clip.items())  # it trained


def test_lora_with_ema_saves_the_average(tmp_path: Path, images: Path) -> None:
    """EMA works for any trained set: a LoRA file written from the average (diffusers layout:
    its up factors carry the scale alpha / rank = 2, exact in fp32)."""
    from safetensors.torch import load_file

    cfg = run_toml(tmp_path, images, steps=3)
    assert train_exit_code(cfg, "train.ema.enabled=true", "train.ema.decay=0.5") == 0
    saved = read(sorted((tmp_path / "out" / "checkpoints").iterdir())[-1])
    lora = load_file(str(tmp_path / "out" / "lora.safetensors"))
    assert saved.ema is not None and lora.keys() == saved.ema.keys()
    for key, value in saved.ema.items():
        assert torch.equal(lora[key], value * (2 if "lora_B" in key else 1)), key
    assert any(not torch.equal(saved.ema[k], saved.trainable[k]) for k in saved.ema)
