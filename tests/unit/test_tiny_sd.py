"""The tiny SDXL and SD3 flavors: deterministic, offline, and usable by diffusers' pipelines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from difftune.families.common.tiny import CLIP_G_WIDTH, CLIP_L_WIDTH
from difftune.families.sd3.tiny import SD3_T5_WIDTH, build_tiny_sd3
from difftune.families.sdxl.tiny import build_tiny_sdxl

BUILDERS: dict[str, Callable[[], dict[str, Any]]] = {
    "sdxl": build_tiny_sdxl,
    "sd3": build_tiny_sd3,
}


@pytest.fixture(scope="module")
def sdxl() -> dict[str, Any]:
    """One tiny SDXL shared by the module's tests."""
    return build_tiny_sdxl()


@pytest.fixture(scope="module")
def sd3() -> dict[str, Any]:
    """One tiny SD3 shared by the module's tests."""
    return build_tiny_sd3()


def _modules(parts: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """The parts that hold weights."""
    return {k: v for k, v in parts.items() if isinstance(v, torch.nn.Module)}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_deterministic_and_rng_untouched(family: str) -> None:
    torch.manual_seed(7)
    before = torch.get_rng_state()
    a = BUILDERS[family]()
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    b = BUILDERS[family]()
    ma, mb = _modules(a), _modules(b)
    assert ma.keys() == mb.keys() and len(ma) >= 4
    for key in ma:
        sa, sb = ma[key].state_dict(), mb[key].state_dict()
        assert sa.keys() == sb.keys()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), key


def test_sdxl_keys_and_shapes(sdxl: dict[str, Any]) -> None:
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    assert set(sdxl) == {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                         "tokenizer_2", "scheduler"}
    assert isinstance(sdxl["unet"], UNet2DConditionModel)
    assert isinstance(sdxl["vae"], AutoencoderKL)
    assert type(sdxl["text_encoder"]) is CLIPTextModel
    assert isinstance(sdxl["text_encoder_2"], CLIPTextModelWithProjection)
    assert isinstance(sdxl["scheduler"], EulerDiscreteScheduler)
    uc, te1, te2 = sdxl["unet"].config, sdxl["text_encoder"].config, sdxl["text_encoder_2"].config
    assert te1.hidden_size != te2.hidden_size
    assert uc.cross_attention_dim == te1.hidden_size + te2.hidden_size
    assert uc.addition_embed_type == "text_time"
    assert uc.projection_class_embeddings_input_dim == (
        te2.projection_dim + 6 * uc.addition_time_embed_dim)
    vc = sdxl["vae"].config
    assert vc.latent_channels == 4 and 2 ** (len(vc.block_out_channels) - 1) == 8
    sc = sdxl["scheduler"].config
    assert (sc.beta_schedule, sc.beta_start, sc.beta_end, sc.num_train_timesteps) == (
        "scaled_linear", 0.00085, 0.012, 1000)
    assert (sc.steps_offset, sc.timestep_spacing, sc.prediction_type) == (
        1, "leading", "epsilon")


def test_sd3_keys_and_shapes(sd3: dict[str, Any]) -> None:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    assert set(sd3) == {"transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3",
                        "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler", "t5_max_length"}
    assert isinstance(sd3["transformer"], SD3Transformer2DModel)
    assert isinstance(sd3["vae"], AutoencoderKL)
    assert isinstance(sd3["text_encoder"], CLIPTextModelWithProjection)
    assert isinstance(sd3["text_encoder_2"], CLIPTextModelWithProjection)
    assert isinstance(sd3["text_encoder_3"], T5EncoderModel)
    assert isinstance(sd3["scheduler"], FlowMatchEulerDiscreteScheduler)
    tc = sd3["transformer"].config
    te1, te2 = sd3["text_encoder"].config, sd3["text_encoder_2"].config
    assert te1.hidden_size != te2.hidden_size
    assert tc.pooled_projection_dim == te1.projection_dim + te2.projection_dim
    assert tc.joint_attention_dim == sd3["text_encoder_3"].config.d_model
    assert tc.joint_attention_dim > te1.hidden_size + te2.hidden_size  # pipeline pads CLIP
    assert tc.caption_projection_dim == tc.num_attention_heads * tc.attention_head_dim
    vc = sd3["vae"].config
    assert vc.latent_channels == tc.in_channels == 16
    assert vc.shift_factor is not None and vc.scaling_factor != 1.0
    assert sd3["scheduler"].config.shift == 3.0 and sd3["t5_max_length"] == 32


def test_tokenizers_fit_encoders(sdxl: dict[str, Any], sd3: dict[str, Any]) -> None:
    for parts in (sdxl, sd3):
        for i in ("", "_2"):
            tok, te = parts[f"tokenizer{i}"], parts[f"text_encoder{i}"]
            assert tok.model_max_length == te.config.max_position_embeddings == 77
            assert tok.pad_token_id is not None and len(tok) == te.config.vocab_size
            assert te.config.eos_token_id == tok.eos_token_id
    assert len(sd3["tokenizer_3"]) <= sd3["text_encoder_3"].config.vocab_size


def test_sdxl_encode_prompt(sdxl: dict[str, Any]) -> None:
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(**sdxl)
    emb, neg, pooled, neg_pooled = pipe.encode_prompt(
        "a red circle", device=torch.device("cpu"), num_images_per_prompt=1,
        do_classifier_free_guidance=True, negative_prompt="blurry")
    width = CLIP_L_WIDTH + CLIP_G_WIDTH
    assert emb.shape == neg.shape == (1, 77, width)
    assert pooled.shape == neg_pooled.shape == (1, CLIP_G_WIDTH)
    assert not torch.equal(emb, neg)


def test_sd3_encode_prompt(sd3: dict[str, Any]) -> None:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(**{k: v for k, v in sd3.items() if k != "t5_max_length"})
    emb, neg, pooled, neg_pooled = pipe.encode_prompt(
        "a red circle", "a red circle", "a red circle", device=torch.device("cpu"),
        do_classifier_free_guidance=True, negative_prompt="blurry", max_sequence_length=32)
    assert emb.shape == neg.shape == (1, 77 + 32, SD3_T5_WIDTH)
    assert pooled.shape == neg_pooled.shape == (1, CLIP_L_WIDTH + CLIP_G_WIDTH)
    # CLIP states are zero-padded up to T5's width; the T5 part is not.
    assert torch.all(emb[:, :77, CLIP_L_WIDTH + CLIP_G_WIDTH:] == 0)
    assert emb[:, 77:].abs().sum() > 0


def test_sdxl_pipeline_runs(sdxl: dict[str, Any]) -> None:
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(**sdxl)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red circle on a blue background", negative_prompt="blurry",
               height=64, width=64, num_inference_steps=2, guidance_scale=5.0,
               generator=torch.Generator().manual_seed(0), output_type="pil")
    assert len(out.images) == 1 and out.images[0].size == (64, 64)


def test_sd3_pipeline_runs(sd3: dict[str, Any]) -> None:
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(**{k: v for k, v in sd3.items() if k != "t5_max_length"})
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt="a red circle on a blue background", negative_prompt="blurry",
               height=64, width=64, num_inference_steps=2, guidance_scale=5.0,
               max_sequence_length=32, generator=torch.Generator().manual_seed(0),
               output_type="pil")
    assert len(out.images) == 1 and out.images[0].size == (64, 64)


def test_sdxl_unet_forward_backward(sdxl: dict[str, Any]) -> None:
    unet = sdxl["unet"]
    gen = torch.Generator().manual_seed(0)
    width = CLIP_L_WIDTH + CLIP_G_WIDTH
    x = torch.randn(2, 4, 8, 8, generator=gen)  # latents of two 64x64 images
    # time ids: original size, crop top-left, target size
    time_ids = torch.tensor([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]).repeat(2, 1)
    added = {"text_embeds": torch.randn(2, CLIP_G_WIDTH, generator=gen),
             "time_ids": time_ids}
    out = unet(x, torch.tensor([10, 900]), encoder_hidden_states=torch.randn(2, 77, width),
               added_cond_kwargs=added).sample
    assert out.shape == x.shape
    out.pow(2).mean().backward()
    assert unet.conv_in.weight.grad is not None
    assert unet.add_embedding.linear_1.weight.grad is not None
    unet.zero_grad(set_to_none=True)


def test_sd3_transformer_forward_backward(sd3: dict[str, Any]) -> None:
    tr = sd3["transformer"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=gen)
    ctx = torch.randn(2, 77 + 32, SD3_T5_WIDTH, generator=gen)
    pooled = torch.randn(2, CLIP_L_WIDTH + CLIP_G_WIDTH, generator=gen)
    out = tr(hidden_states=x, encoder_hidden_states=ctx, pooled_projections=pooled,
             timestep=torch.tensor([10.0, 900.0])).sample
    assert out.shape == x.shape
    out.pow(2).mean().backward()
    assert tr.pos_embed.proj.weight.grad is not None
    assert tr.time_text_embed.text_embedder.linear_1.weight.grad is not None
    tr.zero_grad(set_to_none=True)
