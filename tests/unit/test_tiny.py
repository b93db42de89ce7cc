"""The built-in tiny FLUX.1 flavor: deterministic, offline, and usable by FluxPipeline."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from difftune.verbs.demo import demo_dir
from difftune.families.common.tiny import assets_dir
from difftune.families.flux.tiny import build_tiny_flux


@pytest.fixture(scope="module")
def parts() -> dict:
    """One tiny model shared by the module's tests (building it takes about a second)."""
    return build_tiny_flux()


def test_keys_and_classes(parts: dict) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    assert isinstance(parts["transformer"], FluxTransformer2DModel)
    assert isinstance(parts["vae"], AutoencoderKL)
    assert isinstance(parts["text_encoder"], CLIPTextModel)
    assert isinstance(parts["text_encoder_2"], T5EncoderModel)
    assert isinstance(parts["scheduler"], FlowMatchEulerDiscreteScheduler)
    assert parts["t5_max_length"] == 32
    assert parts["transformer"].config.guidance_embeds
    assert 2 ** (len(parts["vae"].config.block_out_channels) - 1) == 8
    sc = parts["scheduler"].config
    assert (sc.shift, sc.use_dynamic_shifting, sc.base_shift, sc.max_shift) == (3.0, True, 0.5, 1.15)
    assert parts["vae"].config.scaling_factor != 1.0


def test_deterministic_and_rng_untouched() -> None:
    torch.manual_seed(7)
    before = torch.get_rng_state()
    a = build_tiny_flux()
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    b = build_tiny_flux()
    for key in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        sa, sb = a[key].state_dict(), b[key].state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), key


def test_tokenizers_offline(parts: dict) -> None:
    text = "a red circle on a blue background"
    for tok, length in ((parts["tokenizer"], 77), (parts["tokenizer_2"], 32)):
        enc = tok(text, padding="max_length", max_length=length, truncation=True,
                  return_tensors="pt")
        assert enc.input_ids.shape == (1, length)
        assert 500 <= len(tok) <= 2000
    clip_ids = parts["tokenizer"](text).input_ids
    assert parts["tokenizer"].convert_ids_to_tokens(clip_ids)[1:4] == ["a</w>", "red</w>",
                                                                      "circle</w>"]
    assert parts["tokenizer_2"](text).input_ids[-1] == parts["tokenizer_2"].eos_token_id
    assert len(parts["tokenizer_2"]("word " * 100, max_length=32, truncation=True).input_ids) == 32


def test_transformer_forward_backward(parts: dict) -> None:
    tr = parts["transformer"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 64, generator=gen)  # 8x8 latents packed 2x2 -> 16 tokens of 64
    txt = torch.randn(1, 32, 32, generator=gen)
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1] = torch.arange(4).repeat_interleave(4)
    img_ids[:, 2] = torch.arange(4).repeat(4)
    out = tr(hidden_states=x, encoder_hidden_states=txt, pooled_projections=torch.randn(1, 32),
             timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]), img_ids=img_ids,
             txt_ids=torch.zeros(32, 3)).sample
    assert out.shape == x.shape
    out.pow(2).mean().backward()
    assert tr.x_embedder.weight.grad is not None
    tr.zero_grad(set_to_none=True)


def test_vae_reconstructs_demo_image(parts: dict) -> None:
    import numpy as np

    img = Image.open(demo_dir() / "red_circle.png").convert("RGB")
    x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)[None]
    vae = parts["vae"]
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mode()
        rec = vae.decode(z).sample.clamp(-1, 1)
    assert z.shape == (1, 16, 8, 8)
    assert (rec - x).abs().mean().item() / 2 < 0.1  # mean error under 10% of the pixel range


def test_demo_dataset() -> None:
    demo = demo_dir()
    images = sorted(demo.glob("*.png"))
    assert len(images) >= 6
    captions = [(demo / f"{p.stem}.txt").read_text().strip() for p in images]
    assert len(set(captions)) == len(captions)
    prompts = (demo / "prompts.txt").read_text().splitlines()
    assert {line.split(" --")[0] for line in prompts} == set(captions)
    assert all(Image.open(p).size == (64, 64) for p in images)


def test_vae_config_shipped() -> None:
    cfg = json.loads((assets_dir() / "vae_config.json").read_text())
    assert cfg["latent_channels"] == 16 and cfg["scaling_factor"] > 0
    assert (assets_dir() / "vae.safetensors").stat().st_size < 2_000_000


def test_flux_pipeline_runs(parts: dict) -> None:
    from diffusers import FluxPipeline

    pipe = FluxPipeline(**{k: v for k, v in parts.items() if k != "t5_max_length"})
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=["a red circle on a blue background", "orange stripes"], height=64,
               width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=32,
               generator=torch.Generator().manual_seed(0), output_type="pil")
    assert len(out.images) == 2 and out.images[0].size == (64, 64)
