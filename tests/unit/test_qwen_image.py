"""Qwen-Image: what difftune trains on equals QwenImagePipeline.encode_prompt exactly (CPU), the
tiny tokenizer carries Qwen2's special tokens and gives the template's real 34-token prefix,
predict/CFG are the pipeline's, the VAE's per-channel normalization is the pipeline's inverse,
other trainers' LoRA names read as diffusers ones, and the released configs build on meta."""

from __future__ import annotations

import torch

from difftune import families
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.common.latents import pack, unpack
from difftune.families.qwen_image.tiny import build_tiny_qwen_image

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", "", "photo of a blue square"]
# The real Qwen2 tokenizer's tokens of the template's system turn and user header: 34, which
# QwenImagePipeline drops (prompt_template_encode_start_idx).
PREFIX_TOKENS = [
    "<|im_start|>", "system", "Ċ", "Describe", "Ġthe", "Ġimage", "Ġby", "Ġdetailing", "Ġthe",
    "Ġcolor", ",", "Ġshape", ",", "Ġsize", ",", "Ġtexture", ",", "Ġquantity", ",", "Ġtext",
    ",",
    "Ġspatial", "Ġrelationships", "Ġof", "Ġthe", "Ġobjects", "Ġand", "Ġbackground", ":",
    "<|im_end|>", "Ċ", "<|im_start|>", "user", "Ċ",
]


def _pipe_and_family() -> tuple[object, object, object]:
    from diffusers import QwenImagePipeline

    parts = build_tiny_qwen_image()
    pipe = QwenImagePipeline(**{k: parts[k] for k in
                                ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("qwen_image")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly() -> None:
    """A batch of captions of different lengths, and each caption alone, equal the pipeline's
    `encode_prompt` of the same batch (embeddings, mask) bit for bit."""
    pipe, family, comps = _pipe_and_family()
    want, want_mask = pipe.encode_prompt(list(PROMPTS), device="cpu")
    got = family.encode_text(comps, list(PROMPTS)).tensors
    assert torch.equal(got["prompt_embeds"], want)
    assert torch.equal(got["prompt_embeds_mask"], want_mask)
    lengths = want_mask.sum(1).tolist()
    assert len(set(lengths)) == len(PROMPTS)  # really of different lengths
    alone = []
    for prompt in PROMPTS:
        one, one_mask = pipe.encode_prompt([prompt], device="cpu")
        ours = family.encode_text(comps, [prompt])
        assert one_mask is None and bool(ours.tensors["prompt_embeds_mask"].all())
        assert torch.equal(ours.tensors["prompt_embeds"], one)
        alone.append(ours)
    # Cache entries (one caption each) batched back: the batch's layout, and its values up to
    # the rounding by which the pipeline's own output depends on the batch's padding.
    cat = TextEmbeds.cat(alone).tensors
    assert torch.equal(cat["prompt_embeds_mask"], want_mask)
    torch.testing.assert_close(cat["prompt_embeds"], want, rtol=0, atol=1e-5)


def test_tiny_tokenizer_has_qwen2_tokens_and_the_34_token_prefix() -> None:
    from difftune.families.qwen_image.spec import DROP, SPEC, TEMPLATE

    tok = build_tiny_qwen_image()["tokenizer"]
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>",
              "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"):
        assert tok.convert_tokens_to_ids(t) != tok.unk_token_id and len(tok(t)["input_ids"]) == 1
    prefix = TEMPLATE.split("{}")[0]
    ids = tok(prefix)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == PREFIX_TOKENS and len(ids) == DROP == 34
    # The caption's own tokens start right after the dropped prefix.
    full = tok(TEMPLATE.format("a red circle"))["input_ids"]
    assert full[:DROP] == ids and tok.decode(full[DROP:DROP + 3]) == "a red circle"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert tok.padding_side == "right"  # the trim and the drop rely on right padding
    spec = SPEC.text_encoders[0]
    assert (spec.template, spec.drop, spec.max_length) == (TEMPLATE, 34, 1024 + 34)


def test_pipeline_inputs_sample_as_the_pipeline_does_with_prompts() -> None:
    """Our embeddings and CFG 4 give the image QwenImagePipeline makes from the prompt strings
    with true_cfg_scale 4 and the negative prompt."""
    pipe, family, comps = _pipe_and_family()
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", true_cfg_scale=4.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).images
    assert torch.equal(ours, theirs)


def test_predict_is_the_velocity_the_pipeline_steps_with() -> None:
    """The pipeline's first step from pure noise (sigma 1) moves the latents by
    (sigma_1 - 1) * velocity: our `predict` at t = 1 is that velocity, with padded captions."""
    pipe, family, comps = _pipe_and_family()
    latents = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, ["a red circle", "a pink ring on a blue square"])
    seen: list[torch.Tensor] = []

    def grab(p: object, i: int, t: torch.Tensor, kw: dict) -> dict:
        seen.append(kw["latents"].clone())
        return {}

    pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0), latents=pack(latents.clone()),
         height=32, width=32, num_inference_steps=2, output_type="latent",
         callback_on_step_end=grab)
    sigmas = pipe.scheduler.sigmas
    assert float(sigmas[0]) == 1.0
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents, embeds, torch.ones(2), cond)
    stepped = unpack(seen[0], 4, 4)
    torch.testing.assert_close(stepped, latents + (sigmas[1] - sigmas[0]) * velocity,
                               rtol=0, atol=1e-5)


def test_latents_are_normalized_per_channel_as_the_pipeline_decodes() -> None:
    """encode_images gives (z - mean) / std of the VAE's mode; `vae.decode` (what the pipeline
    does: latents * std + mean, one frame) reads them back to the VAE's own decoding."""
    from difftune.families.common import frame_vae as vae

    _, family, comps = _pipe_and_family()
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    latents = family.encode_images(comps, pixels)
    assert latents.shape == (1, 16, 4, 4)
    z = comps.vae.encode(pixels.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    mean, std = vae.channel_stats(comps.vae, z)
    assert not torch.equal(mean, torch.zeros_like(mean))
    torch.testing.assert_close(latents * std + mean, z)
    with torch.no_grad():
        direct = comps.vae.decode(z.unsqueeze(2), return_dict=False)[0][:, :, 0]
    torch.testing.assert_close(vae.decode(comps.vae, latents), direct)


def test_released_config_builds_on_meta() -> None:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    from difftune.families.common.frame_vae import RELEASED_CONFIG as VAE_CONFIG
    from difftune.families.qwen_image.files import TRANSFORMER_CONFIG, text_encoder_config

    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel(**TRANSFORMER_CONFIG)
        encoder = Qwen2_5_VLForConditionalGeneration(text_encoder_config())
        autoencoder = AutoencoderKLQwenImage(**VAE_CONFIG)
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert 20.3e9 < count(transformer) < 20.5e9, count(transformer)  # Qwen-Image's "20B" MMDiT
    assert 8.2e9 < count(encoder) < 8.4e9, count(encoder)  # Qwen2.5-VL-7B with vision and head
    assert 0.12e9 < count(autoencoder) < 0.13e9, count(autoencoder)


def test_other_trainers_lora_names_read_as_diffusers() -> None:
    from difftune.families.common.diffusers_layout import diffusers_names

    a, b = torch.ones(4, 8), torch.zeros(8, 4)
    q = "transformer_blocks.0.attn.to_q"
    want = {f"transformer.{q}.lora_A.weight": a, f"transformer.{q}.lora_B.weight": b}
    ai_toolkit = {f"diffusion_model.{q}.lora_A.weight": a, f"diffusion_model.{q}.lora_B.weight": b}
    assert diffusers_names(ai_toolkit) == (want, {})
    comfy = {f"model.diffusion_model.{q}.lora_down.weight": a,
             f"model.diffusion_model.{q}.lora_up.weight": b,
             f"model.diffusion_model.{q}.alpha": torch.tensor(2.0)}
    assert diffusers_names(comfy) == (want, {f"transformer.{q}": 2.0})
    kohya = {"lora_unet_transformer_blocks_0_attn_to_q.lora_down.weight": a,
             "lora_unet_transformer_blocks_0_attn_to_q.lora_up.weight": b,
             "lora_unet_transformer_blocks_0_attn_to_q.alpha": torch.tensor(4.0)}
    assert diffusers_names(kohya, [q, "transformer_blocks.0.attn"]) == (
        want, {f"transformer.{q}": 4.0})
    bare = {f"{q}.lora_A.weight": a, f"{q}.lora_B.weight": b}
    assert diffusers_names(bare, [q]) == (want, {})
    lycoris = {"lycoris_transformer_blocks_0_attn_to_q.lora_down.weight": a,
               "lycoris_transformer_blocks_0_attn_to_q.lora_up.weight": b}
    assert diffusers_names(lycoris, [q]) == (want, {})
    assert diffusers_names(want, [q]) == (want, {})


def test_cache_key_fields_grow_only_where_decoder_fields_are_set() -> None:
    """The template, drop, layers and pad fields enter Qwen-Image's key; encoders without them
    keep the key fields they had."""
    from difftune.families.specs import DECODER_FIELDS

    for name in families.names():
        for spec in families.spec(name).text_encoders:
            fields = spec.key_fields()
            for field in DECODER_FIELDS:
                default = spec.__dataclass_fields__[field].default
                assert (field in fields) == (getattr(spec, field) != default), (name, field)
    qwen = families.spec("qwen_image").text_encoders[0].key_fields()
    assert qwen["drop"] == 34 and qwen["layers"] == (-1,) and qwen["pad"] == "longest"
    assert "chat" not in qwen


def test_flux_shift_is_the_pipelines_resolution_dependent_shift() -> None:
    """`train.timesteps = "flux_shift"` shifts t by exp(mu) with mu as QwenImagePipeline computes
    it for the image's token count (its scheduler's constants, not FLUX.1's), which is what its
    exponential time shift does to a sigma."""
    import math

    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from difftune.config import TrainConfig
    from difftune.train.objectives.flow import shift_time

    _, family, comps = _pipe_and_family()
    objective = family.objective(comps, TrainConfig(timesteps="flux_shift"))
    sc = comps.scheduler.config
    for tokens in (64, 256, 1024, 4096, 8192):
        want = calculate_shift(tokens, sc["base_image_seq_len"], sc["max_image_seq_len"],
                               sc["base_shift"], sc["max_shift"])
        assert math.isclose(objective.dynamic.mu(tokens), want, rel_tol=1e-12)
    sigma = torch.tensor([0.25, 0.5, 0.75])
    comps.scheduler.set_timesteps(sigmas=sigma.tolist(), mu=1.0)
    theirs = comps.scheduler.time_shift(1.0, 1.0, sigma)
    torch.testing.assert_close(shift_time(sigma, math.exp(1.0)), theirs)
