"""Text-encoder LoRA through the real CLI: live trained encoders, cached frozen ones, and files
that diffusers' own loaders read (FLUX.1 diffusers layout, SDXL kohya layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionXLPipeline
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from difftune.families.common import text
from difftune.families.flux.tiny import build_tiny_flux
from difftune.families.sdxl.tiny import build_tiny_sdxl

from .test_sdxl import train as train_sdxl
from .test_train_cli import train as train_flux


@pytest.fixture(scope="module")
def flux_clip_run(tmp_path_factory: pytest.TempPathFactory, images: Path) -> tuple[Path, list]:
    """A FLUX.1 run training CLIP-L with text caching on; records every encoder call."""
    calls: list[tuple[str, bool]] = []
    real = text.encode

    def counting(spec, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((spec.name, torch.is_grad_enabled()))
        return real(spec, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text, "encode", counting)
        out = train_flux(tmp_path_factory.mktemp("flux_te"), images,
                         'adapter.text_encoders=["clip_l"]', "adapter.text_encoder_lr=5e-3")
    return out, calls


def test_t5_cached_and_clip_live(flux_clip_run: tuple[Path, list], images: Path) -> None:
    _, calls = flux_clip_run
    captions = {p.read_text().strip() for p in images.glob("*.txt")}
    t5 = [grad for name, grad in calls if name == "t5"]
    clip = [grad for name, grad in calls if name == "clip_l"]
    # T5: once per distinct caption while filling the cache, never with gradients.
    assert len(t5) <= len(captions) + 1 and not any(t5)
    # CLIP-L: live at every step (4 steps), with gradients.
    assert sum(clip) == 4


def _flux_pipe() -> FluxPipeline:
    parts = build_tiny_flux()
    parts.pop("t5_max_length")
    pipe = FluxPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _flux_image(pipe: FluxPipeline) -> torch.Tensor:
    return pipe("a red circle on a blue background", height=32, width=32, num_inference_steps=2,
                max_sequence_length=32, generator=torch.Generator().manual_seed(0),
                output_type="pt").images


def test_flux_clip_lora_loads_into_pipeline(flux_clip_run: tuple[Path, list]) -> None:
    out, _ = flux_clip_run
    file = load_file(str(out / "lora.safetensors"))
    te = {k: v for k, v in file.items() if k.startswith("text_encoder.")}
    assert te and not any(k.startswith("text_encoder_2.") for k in file)
    # B starts at zero: a nonzero B means CLIP-L's LoRA was trained.
    assert any(torch.count_nonzero(v) for k, v in te.items() if "lora_B" in k)
    pipe = _flux_pipe()
    before = _flux_image(pipe)
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    after = _flux_image(pipe)
    assert not torch.allclose(before, after, atol=1e-4)
    loaded = {f"transformer.{k}": v for k, v in
              get_peft_model_state_dict(pipe.transformer, adapter_name="default_0").items()}
    loaded |= {f"text_encoder.{k}": v for k, v in
               get_peft_model_state_dict(pipe.text_encoder, adapter_name="default_0").items()}
    # No leftover key. The file names CLIP-L's modules under `text_model.` (as ComfyUI and
    # transformers 4 do); diffusers drops that root for transformers 5's flattened CLIPTextModel.
    named = {k.replace("text_encoder.text_model.", "text_encoder."): v for k, v in file.items()}
    assert set(loaded) == set(named)
    for key, value in loaded.items():
        assert torch.equal(value, named[key])


def test_sdxl_both_clips_kohya_loads_through_diffusers(images: Path, tmp_path: Path) -> None:
    out = train_sdxl(tmp_path / "sdxl", images, 'adapter.text_encoders=["clip_l","clip_g"]',
                     fmt="kohya")
    file = load_file(str(out / "lora.safetensors"))
    prefixes = {k.split("_", 2)[1] for k in file}
    assert prefixes == {"unet", "te1", "te2"}
    pipe = StableDiffusionXLPipeline(**build_tiny_sdxl())
    pipe.set_progress_bar_config(disable=True)

    def image() -> torch.Tensor:
        return pipe("a red circle", height=64, width=64, num_inference_steps=2,
                    guidance_scale=5.0, generator=torch.Generator().manual_seed(0),
                    output_type="pt").images

    before = image()
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    for encoder in (pipe.text_encoder, pipe.text_encoder_2):
        state = get_peft_model_state_dict(encoder, adapter_name="default_0")
        assert state and any(torch.count_nonzero(v) for k, v in state.items() if "lora_B" in k)
    n_te = sum(len(get_peft_model_state_dict(e, adapter_name="default_0"))
               for e in (pipe.text_encoder, pipe.text_encoder_2))
    n_unet = len(get_peft_model_state_dict(pipe.unet, adapter_name="default_0"))
    assert 3 * (n_te + n_unet) == 2 * len(file)  # every module (down, up, alpha) was read
    assert not torch.allclose(before, image(), atol=1e-4)
