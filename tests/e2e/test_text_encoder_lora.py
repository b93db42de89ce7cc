"""Text-encoder LoRA through the real CLI: live trained encoders, cached frozen ones, and files
that diffusers' own loaders read (FLUX.1 diffusers layout, SDXL kohya layout)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from difftune.families.common import text

from .conftest import pipeline_image, tiny_pipeline, train_cli

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


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
        out = train_cli(tmp_path_factory.mktemp("flux_te"), images,
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


def _flux_image(pipe: "DiffusionPipeline") -> torch.Tensor:
    return pipeline_image(pipe, "a red circle on a blue background")


def test_flux_clip_lora_loads_into_pipeline(flux_clip_run: tuple[Path, list]) -> None:
    out, _ = flux_clip_run
    file = load_file(str(out / "lora.safetensors"))
    te = {k: v for k, v in file.items() if k.startswith("text_encoder.")}
    assert te and not any(k.startswith("text_encoder_2.") for k in file)
    # B starts at zero: a nonzero B means CLIP-L's LoRA was trained.
    assert any(torch.count_nonzero(v) for k, v in te.items() if "lora_B" in k)
    pipe = tiny_pipeline("flux")
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
    out = train_cli(tmp_path / "sdxl", images, 'adapter.text_encoders=["clip_l","clip_g"]',
                    family="sdxl", fmt="kohya")
    file = load_file(str(out / "lora.safetensors"))
    prefixes = {k.split("_", 2)[1] for k in file}
    assert prefixes == {"unet", "te1", "te2"}
    pipe = tiny_pipeline("sdxl")

    def image() -> torch.Tensor:
        return pipeline_image(pipe, "a red circle", 64, guidance_scale=5.0)

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
