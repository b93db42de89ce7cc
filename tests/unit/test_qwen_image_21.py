"""Qwen-Image 2.1: what difftune trains on equals QwenImage21Pipeline.encode_prompt exactly (CPU),
the tiny tokenizer gives the real 14-token system message, predict and CFG are the pipeline's,
the RGBA autoencoder's latents are the pipeline's, flux_shift follows the pipeline's mu, Turbo is
told apart by its sampling grid, and the released configs build on the meta device."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch

from difftune import families
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.qwen_image_21.family import from_tokens, to_tokens
from difftune.families.qwen_image_21.tiny import build_tiny_qwen_image_21

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", "", "photo of a blue square"]
# The real Qwen tokenizer's tokens of the system message QwenImage21Pipeline drops (its
# `_drop_idx`), as Qwen2.5's vocabulary (the one Qwen3 shares) splits them.
SYSTEM_TOKENS = ["<|im_start|>", "system", "Ċ", "Com", "preh", "end", "Ġand", "Ġanalyze", "Ġthe",
                 "Ġprovided", "Ġprompt", ".", "<|im_end|>", "Ċ"]


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, Any]:
    """The pipeline over the tiny parts, the family and its components (same modules)."""
    from diffusers import QwenImage21Pipeline

    parts = build_tiny_qwen_image_21()
    pipe = QwenImage21Pipeline(**{k: parts[k] for k in ("transformer", "vae", "text_encoder",
                                                          "processor", "scheduler")})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("qwen_image_21")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly(setup: tuple[Any, Any, Any]) -> None:
    """A left-padded batch of captions of different lengths (an empty one among them), and
    each caption alone, equal the pipeline's `encode_prompt` of the same batch or caption bit
    for bit: the pre-norm last layer, system turn dropped, rows right-padded."""
    pipe, family, comps = setup
    want, want_mask, image_slots = pipe.encode_prompt(list(PROMPTS), device="cpu")
    assert not bool(image_slots.any()) and len(set(want_mask.sum(1).tolist())) == len(PROMPTS)
    batch = family.encode_text(comps, list(PROMPTS)).tensors
    assert torch.equal(batch["prompt_embeds"], want)
    assert torch.equal(batch["prompt_embeds_mask"], want_mask)
    alone = []
    for prompt in PROMPTS:
        one, one_mask, _ = pipe.encode_prompt([prompt], device="cpu")
        ours = family.encode_text(comps, [prompt])
        assert one_mask is None and bool(ours.tensors["prompt_embeds_mask"].all())
        assert torch.equal(ours.tensors["prompt_embeds"], one)
        alone.append(ours)
    # Cache entries batched back: the batch's layout, and its values up to the rounding by
    # which the pipeline's own output depends on the batch's padding.
    cat = TextEmbeds.cat(alone).tensors
    assert torch.equal(cat["prompt_embeds_mask"], want_mask)
    torch.testing.assert_close(cat["prompt_embeds"], want, rtol=0, atol=1e-5)


def test_tiny_tokenizer_gives_the_real_system_message(setup: tuple[Any, Any, Any]) -> None:
    """The processor's system message is the real tokenizer's 14 tokens, which the pipeline
    derives as its drop and the spec declares; Qwen's special tokens are single tokens."""
    from difftune.families.qwen_image_21.spec import DROP, SPEC, SYSTEM, TEMPLATE

    pipe, _, comps = setup
    tok = comps.tokenizers["qwen3vl"]
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    ids = comps.extras["processor"].apply_chat_template(message, tokenize=True,
                                                        return_dict=False)[0]
    assert tok.convert_ids_to_tokens(ids) == SYSTEM_TOKENS
    assert pipe._drop_idx == DROP == len(SYSTEM_TOKENS) == SPEC.text_encoders[0].drop
    full = tok(TEMPLATE.format("a red circle"))["input_ids"]
    assert full[:DROP] == ids and tok.decode(full[DROP:DROP + 3]) == "<|im_start|>user\n"
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|image_pad|>"):
        assert len(tok(t)["input_ids"]) == 1


def test_predict_is_the_velocity_the_pipeline_steps_with(setup: tuple[Any, Any, Any]) -> None:
    """The pipeline's first step from pure noise (sigma 1) moves the latents by
    (sigma_1 - 1) * velocity: our `predict` at t = 1 is that velocity for each caption of a
    batch of captions of different lengths (padded, masked), as the pipeline gives it for that
    caption alone (a padded caption would take other RoPE positions)."""
    pipe, family, comps = setup
    latents = torch.randn(3, 64, 2, 4, generator=torch.Generator().manual_seed(3))
    captions = ["a red circle", "a pink ring on a blue square", "a blue circle"]
    embeds = family.encode_text(comps, captions)
    assert not bool(embeds.tensors["prompt_embeds_mask"].all())
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents, embeds, torch.ones(3), cond)
    for i, caption in enumerate(captions):
        seen: list[torch.Tensor] = []

        def grab(p: object, step: int, t: torch.Tensor, kw: dict) -> dict:
            seen.append(kw["latents"].clone())
            return {}

        alone = family.encode_text(comps, [caption])
        pipe(**family.pipeline_inputs(alone, None, 1.0, 1.0),
             latents=to_tokens(latents[i:i + 1].clone()), height=32, width=64,
             num_inference_steps=2, output_type="latent", callback_on_step_end=grab)
        sigmas = pipe.scheduler.sigmas
        assert float(sigmas[0]) == 1.0
        torch.testing.assert_close(from_tokens(seen[0], 2, 4),
                                   latents[i:i + 1] + (sigmas[1] - sigmas[0]) * velocity[i:i + 1],
                                   rtol=0, atol=1e-5)


def test_cfg_samples_as_the_pipeline_does_with_prompts(setup: tuple[Any, Any, Any]) -> None:
    """Our embeddings and CFG 4 give the image the pipeline makes from the prompt strings
    with true_cfg_scale 4 and the negative prompt."""
    pipe, family, comps = setup
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", true_cfg_scale=4.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).images
    assert torch.equal(ours, theirs)


def test_latents_are_the_pipelines_rgba_latents(setup: tuple[Any, Any, Any]) -> None:
    """An RGB image gets an opaque alpha channel, as the pipeline converts its images to RGBA
    (VaeImageProcessor: alpha 255 is 1.0), then (z - mean) / std of the mode: what
    `_encode_vae_image` gives for the same image; 16x down."""
    pipe, family, comps = setup
    pixels = torch.rand(1, 3, 32, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = family.encode_images(comps, pixels)
    assert latents.shape == (1, 64, 2, 4)
    rgba = torch.cat([pixels, torch.ones(1, 1, 32, 64)], dim=1).unsqueeze(2)
    with torch.no_grad():
        want = pipe._encode_vae_image(rgba, None)[:, :, 0]
    torch.testing.assert_close(latents, want)


def test_flux_shift_follows_the_pipelines_mu(setup: tuple[Any, Any, Any]) -> None:
    """`flux_shift`'s mu for latents of h x w equals the pipeline's calculate_shift at its
    h x w image tokens (the objective counts tokens in 2 x 2 patches)."""
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    pipe, family, comps = setup
    dynamic = family.objective(comps, type("Train", (), {})()).dynamic
    config = comps.scheduler.config
    for h, w in ((16, 16), (64, 64), (48, 80)):
        want = calculate_shift(h * w, config["base_image_seq_len"], config["max_image_seq_len"],
                               config["base_shift"], config["max_shift"])
        assert dynamic.mu(h * w // 4) == pytest.approx(want, abs=1e-12)


def test_turbo_is_told_apart_by_its_sampling_grid(setup: tuple[Any, Any, Any]) -> None:
    """A folder whose model_index.json ships `sample_sigmas` is Turbo (diffusers' modular
    loader's rule): `distilled` says so and its pipeline samples on that grid."""
    _, family, comps = setup
    assert not family.distilled(comps)
    assert family.pipeline(comps).config.sample_sigmas is None
    turbo = copy.copy(comps)
    turbo.extras = {**comps.extras, "pipeline_options": {"sample_sigmas": [1.0, 0.5]}}
    assert family.distilled(turbo)
    assert family.pipeline(turbo).config.sample_sigmas == [1.0, 0.5]


def test_released_configs_build_on_meta() -> None:
    """The released transformer (QwenImage21Transformer2DModel's defaults), RGBA autoencoder
    and Qwen3-VL-8B build on the meta device with the spec's parameter counts."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from difftune.families.qwen_image_21.files import (TEXT_CONFIG, TRANSFORMER_CONFIG,
                                                       VAE_CONFIG, VISION_CONFIG)
    from difftune.families.qwen_image_21.spec import SPEC

    with torch.device("meta"):
        transformer = QwenImage21Transformer2DModel(**TRANSFORMER_CONFIG)
        encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=TEXT_CONFIG, vision_config=VISION_CONFIG, tie_word_embeddings=False))
        autoencoder = AutoencoderKLQwenImage21(**VAE_CONFIG)
    count = lambda m: sum(p.numel() for p in m.parameters())
    size = SPEC.sizes[0]
    assert count(transformer) / 1e9 == pytest.approx(size.denoiser, abs=0.005)  # 7.115B
    assert count(encoder) / 1e9 == pytest.approx(size.encoders, abs=0.005)
    defaults = inspect.signature(QwenImage21Transformer2DModel.__init__).parameters
    assert all(defaults[k].default == v for k, v in TRANSFORMER_CONFIG.items()), "defaults"
    assert 0.33e9 < count(autoencoder) < 0.34e9, count(autoencoder)  # RGBA, 64 channels
    assert (size.layers, size.width) == (32, 4096)


def test_original_layout_fuses_gate_and_up_and_reads_back_exactly() -> None:
    """save.format = "original": each block's gate and up LoRAs become one LoRA of the
    checkpoint's fused `img_mlp.gate_up` whose delta is the two deltas stacked (gate rows
    first, a part not trained contributing zero rows), scale folded; reading it back gives the
    deltas it was written from."""
    from difftune.adapters.formats import group_modules
    from difftune.families.qwen_image_21.keys import split_fused, to_original

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    state = {"transformer.transformer_blocks.0.img_mlp.gate_layer.lora_A.weight": rand(2, 8),
             "transformer.transformer_blocks.0.img_mlp.gate_layer.lora_B.weight": rand(24, 2),
             "transformer.transformer_blocks.0.img_mlp.proj.lora_A.weight": rand(2, 8),
             "transformer.transformer_blocks.0.img_mlp.proj.lora_B.weight": rand(24, 2),
             "transformer.transformer_blocks.1.img_mlp.proj.lora_A.weight": rand(2, 8),
             "transformer.transformer_blocks.1.img_mlp.proj.lora_B.weight": rand(24, 2),
             "transformer.transformer_blocks.1.attn.to_q.lora_A.weight": rand(2, 8),
             "transformer.transformer_blocks.1.attn.to_q.lora_B.weight": rand(8, 2)}
    ours = group_modules(state, 8.0)  # alpha 8 at rank 2: scale 4
    written = to_original(state, 2, 8.0)
    assert not any(k.endswith(".alpha") for k in written)
    pairs = group_modules({k.replace("diffusion_model.", "transformer.", 1): v
                           for k, v in written.items()}, 1.0)
    fused = pairs["transformer.transformer_blocks.0.img_mlp.gate_up"]
    gate = ours["transformer.transformer_blocks.0.img_mlp.gate_layer"].delta()
    up = ours["transformer.transformer_blocks.0.img_mlp.proj"].delta()
    torch.testing.assert_close(fused.up @ fused.down, torch.cat([gate, up]))
    half = pairs["transformer.transformer_blocks.1.img_mlp.gate_up"]
    assert not bool((half.up @ half.down)[:24].any())
    back, alphas = split_fused({k.replace("diffusion_model.", "transformer.", 1): v
                                for k, v in written.items()}, {})
    # No alpha in the file: scale 1, alpha = rank (2) for the modules written as they were.
    read = group_modules(back, {**{m: 2.0 for m in ours}, **alphas})
    for module, pair in ours.items():
        torch.testing.assert_close(read[module].delta(), pair.delta())
