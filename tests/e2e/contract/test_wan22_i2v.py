"""Wan 2.2 I2V A14B (`model.variant = "2.2-i2v-a14b"`) through the real CLI on the tiny flavor:
both experts trained on images conditioned on themselves, each step on its side of the 0.9
boundary, exact resume, one LoRA per expert that ComfyUI's key map and WanImageToVideoPipeline's
loader read as trained, samples from a start image (`--ci`) equal to the pipeline's own with
the pair loaded, and `check` refusing LoRAs of the other task with the reason.

One shared run (2 steps, the experts alternating every step: high, low) and its
stopped-at-step-1-and-resumed twin serve every test here (test_wan22 covers longer turns)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from difftune.cli import main

from ...comfy_keymap import unmapped
from ..conftest import metrics_rows, run_toml
from .test_wan22 import EXPERTS, _pixels, _same_updates, recorded_runs

I2V = 'flavor = "tiny"\nvariant = "2.2-i2v-a14b"'
SETS = ("train.expert_switch_every=1", "sample.every_n_steps=100", "sample.at_start=false")
STEPS, STOP = 2, 1
BOUNDARY = 900.0  # WanImageToVideoPipeline's boundary_ratio 0.9 x num_train_timesteps 1000
PROMPT, SEED, SIDE, SAMPLE_STEPS = "a red circle", 7, 16, 4
WAN_PARTS = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler")


def run_files(root: Path, images: Path, model: str, steps: int, sample_steps: int,
              more: str = "") -> tuple[list[Path], Path]:
    """Run files `a` and `b` under `root` training `model` on `images`, sampling the prompt
    from a start image (one of the images, copied to `root`) and the prompt lines `more`:
    (the run files, the start image)."""
    start = root / "start.png"
    shutil.copy(sorted(images.glob("*.png"))[0], start)
    prompts = root / "prompts.txt"
    prompts.write_text(f"{PROMPT} --w {SIDE} --h {SIDE} --s {sample_steps} --d {SEED} "
                       f"--ci start.png\n{more}", encoding="utf-8")
    return [run_toml(root / name, images, steps=steps, prompts=prompts, fmt=None,
                     family="wan", model=model) for name in ("a", "b")], start


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, images: Path) -> dict:
    """Run `a` through and run `b` stopped after step 1 and resumed, recording the timesteps
    and input channels of each training forward of the two experts."""
    root = tmp_path_factory.mktemp("wan22_i2v")
    cfgs, start = run_files(root, images, I2V, STEPS, SAMPLE_STEPS,
                            "no start image --w 16 --h 16 --s 1\n")
    rows, seen = recorded_runs(cfgs, STOP, *SETS)
    return {"cfg": cfgs[0], "a": root / "a" / "out", "b": root / "b" / "out", "rows": rows,
            "seen": seen, "start": start}


def test_both_experts_train_on_their_side_and_resume_exactly(runs: dict) -> None:
    """Every training forward reads 36 channels (16 noisy + 20 of the condition); a high-noise
    step's timesteps are >= 900, a low-noise step's below; stopped after high's step and
    resumed in low's, the losses and both LoRAs are bitwise those of the uninterrupted run."""
    turns = ["high", "low"]
    expected = turns + turns[:STOP] + turns[STOP:]
    assert len(runs["seen"]) == len(expected)
    for (t, channels), expert in zip(runs["seen"], expected):
        assert channels == 36
        assert bool((t >= BOUNDARY).all()) if expert == "high" else bool((t < BOUNDARY).all())
    assert runs["rows"][0] == runs["rows"][1]
    for suffix in ("_high_noise", "_low_noise"):
        wa, wb = (load_file(str(runs[r] / f"lora{suffix}.safetensors")) for r in "ab")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _i2v_pipeline(out: Path):  # noqa: ANN202 - a WanImageToVideoPipeline
    """The tiny I2V pair in WanImageToVideoPipeline with the run's pair loaded as users load
    it (the low-noise file with `load_into_transformer_2`)."""
    from diffusers import WanImageToVideoPipeline

    from difftune.families.wan.tiny import build_tiny_wan

    pipe = WanImageToVideoPipeline(**build_tiny_wan("2.2-i2v-a14b"))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out / "lora_high_noise.safetensors"), adapter_name="high")
    pipe.load_lora_weights(str(out / "lora_low_noise.safetensors"), adapter_name="low",
                           load_into_transformer_2=True)
    return pipe


def start_sampler(pipe: Any, start: Path, guidance: float, steps: int
                  ) -> Callable[[], np.ndarray]:
    """A function sampling WanImageToVideoPipeline `pipe` at PROMPT, SEED and SIDE from the
    start image `start` with CFG `guidance`: the sample's 8-bit values, as a run writes them.
    The prompt as WanPipeline.encode_prompt encodes it at 512 tokens (the I2V pipeline's is a
    copy, but diffusers 0.42.1's pipeline_wan_i2v calls ftfy without checking it is
    installed)."""
    from diffusers import WanPipeline

    embeds, negative = WanPipeline(**{k: getattr(pipe, k) for k in WAN_PARTS}).encode_prompt(
        PROMPT, device="cpu", max_sequence_length=512)

    def sample() -> np.ndarray:
        result = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative,
                      image=Image.open(start).convert("RGB"), height=SIDE, width=SIDE,
                      num_frames=1, guidance_scale=guidance, num_inference_steps=steps,
                      generator=torch.Generator("cpu").manual_seed(SEED), output_type="np")
        return (np.asarray(result.frames[0][0]) * 255).round().astype(int)
    return sample


def test_the_pair_is_read_by_comfyui_and_samples_as_the_pipeline_does(runs: dict) -> None:
    """Every key of both files is in ComfyUI's Wan key map; in WanImageToVideoPipeline each
    file gives its expert the update the run trained; the run's final sample from the start
    image is, pixel for pixel, what that pipeline makes from the prompt and the image; the
    prompt without a start image was skipped."""
    out = runs["a"]
    trained = load_file(str(out / f"checkpoints/step-{STEPS:06d}/trainable.safetensors"))
    pipe = _i2v_pipeline(out)
    for name, part in EXPERTS.items():
        assert unmapped("wan", list(load_file(str(out / f"lora_{name}_noise.safetensors")))) == []
        _same_updates(getattr(pipe, part), name, trained, f"transformer.{part}.")
    samples = sorted((out / "samples").glob(f"step-{STEPS:06d}_*.png"))
    assert [p.name.split("_", 2)[1] for p in samples if "grid" not in p.name] == ["00"]
    sample = start_sampler(pipe, runs["start"], 3.5, SAMPLE_STEPS)

    ours, theirs = _pixels(samples[0]), sample()
    # diffusers' converter folds alpha / rank into the down factors (peft scales at run
    # time during training): the same update, rounded otherwise, one level at most.
    assert np.abs(theirs - ours).max() <= 1
    pipe.disable_lora()
    assert np.abs(sample() - ours).max() >= 4  # the LoRAs changed the sample


def test_check_refuses_loras_of_the_other_task(runs: dict, images: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The run's I2V pair on the T2V A14B model, a T2V-trained pair on the I2V one (their
    modelspec.architecture), and a Wan 2.1 I2V LoRA (k_img / v_img) on the 2.2 I2V model:
    `check --init-lora` exits 2 naming the reason; the run's own pair passes (with a note on
    its still images)."""
    out = runs["a"]
    cfg = run_toml(tmp_path, images, family="wan", model=I2V, fmt=None)
    assert main(["check", str(cfg), "--init-lora", str(out / "lora_high_noise.safetensors")]) == 0
    # (the run's images are stills: check says what they teach an image-to-video model)
    assert "6 still image(s): an image-to-video model" in capsys.readouterr().out
    t2v = tmp_path / "t2v"
    t2v.mkdir()
    for name in ("high", "low"):
        tensors = load_file(str(out / f"lora_{name}_noise.safetensors"))
        save_file(tensors, str(t2v / f"lora_{name}_noise.safetensors"),
                  {"modelspec.architecture": "wan-2.2-t2v-a14b/lora"})
    wan21 = dict(tensors)
    for part in ("k_img", "v_img"):
        wan21[f"diffusion_model.blocks.0.cross_attn.{part}.lora_A.weight"] = torch.zeros(4, 36)
        wan21[f"diffusion_model.blocks.0.cross_attn.{part}.lora_B.weight"] = torch.zeros(36, 4)
    save_file(wan21, str(tmp_path / "wan21_i2v_low_noise.safetensors"))
    cases = [('model.variant="2.2-t2v-a14b"', out / "lora_high_noise.safetensors",
              "a image-to-video model, and this model (2.2-t2v-a14b) is text-to-video"),
             (None, t2v / "lora_high_noise.safetensors",
              "a text-to-video model, and this model (2.2-i2v-a14b) is image-to-video"),
             (None, tmp_path / "wan21_i2v_low_noise.safetensors",
              "Wan 2.1 image-to-video LoRA (it adapts cross_attn.k_img")]
    for setting, path, said in cases:
        sets = ["--set", setting] if setting else []
        assert main(["check", str(cfg), *sets, "--init-lora", str(path)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, err


@pytest.mark.full_only  # the condition of a clip is compared with the pipeline's in unit tests
def test_clips_train_on_their_first_frame_with_a_disk_cache_and_validation(
        images: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 9-frame clip and an image in one run with disk-cached latents and a validation set:
    each entry carries its condition ((20, f, h, w): the mask's 4 channels, one on the first
    latent frame only, and 16 of the encoded start), it is read back from the disk cache on a
    second run, and validation runs the experts with it."""
    from tests.videos import record_entries, write_video

    data = tmp_path / "data"
    data.mkdir()
    write_video(data / "clip.mp4", 9)
    shutil.copy(sorted(images.glob("*.png"))[0], data / "still.png")
    (data / "still.txt").write_text("a still", encoding="utf-8")
    extra = (f'\n[cache]\nlatents = "disk"\ndir = "{(tmp_path / "cache").as_posix()}"\n'
             f'\n[validation]\npath = "{images.as_posix()}"\nevery_n_steps = 2\n')
    cfg = run_toml(tmp_path / "run", data, steps=2, family="wan", model=I2V, fmt=None,
                   extra=extra)
    cfg.write_text(cfg.read_text(encoding="utf-8").replace(
        "max_side = 128\n", 'max_side = 128\nframes = [9]\nclips = "head"\n'), encoding="utf-8")
    seen = record_entries(monkeypatch)
    assert main(["train", str(cfg), "--no-progress", "--set", "train.expert_switch_every=1"]) == 0
    starts = {tuple(e["latent"].shape): e["start"] for _, e in seen}
    assert set(starts) == {(16, 3, 6, 10), (16, 8, 8)}  # 9 frames fold into 3; an image
    for shape, start in starts.items():
        frames = shape[1] if len(shape) == 4 else 1
        assert start.shape == (20, frames, *shape[-2:])
        assert start[:4, 0].eq(1).all() and not start[:4, 1:].any()
    rows = metrics_rows(tmp_path / "run" / "out")
    assert any("val_loss" in r for r in rows)
    seen.clear()
    assert main(["train", str(cfg), "--no-progress", "--set", "train.expert_switch_every=1",
                 "--set", f'save.dir="{(tmp_path / "again").as_posix()}"']) == 0
    assert not [e for item, e in seen if item.clip is not None]  # the clip came from the disk
    assert metrics_rows(tmp_path / "again")[-1]["loss"] == rows[-1]["loss"]
