"""ERNIE-Image: what difftune trains on equals ErnieImagePipeline.encode_prompt exactly (CPU),
its latents and velocity are the ones the pipeline decodes and steps with, the tiny tokenizer
carries Mistral's control tokens, and the released model's config builds on the meta device."""

from __future__ import annotations

import torch

from difftune import families
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.ernie_image.family import caption_list
from difftune.families.ernie_image.tiny import build_tiny_ernie_image

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", ""]
COMMON = {"height": 32, "width": 32, "output_type": "latent"}


def _pipe_and_family() -> tuple[object, object, object]:
    from diffusers import ErnieImagePipeline

    parts = build_tiny_ernie_image()
    pipe = ErnieImagePipeline(**{k: parts[k] for k in
                                 ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("ernie_image")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly() -> None:
    """Equal to ErnieImagePipeline.encode_prompt and to the modular pipeline's text step
    (ErnieImageTextEncoderStep), which encode each prompt alone."""
    from diffusers.modular_pipelines.ernie_image.encoders import ErnieImageTextEncoderStep

    pipe, family, comps = _pipe_and_family()
    want = pipe.encode_prompt(list(PROMPTS), device="cpu")
    modular = ErnieImageTextEncoderStep._encode(pipe.text_encoder, pipe.tokenizer, list(PROMPTS),
                                                torch.device("cpu"))
    assert all(torch.equal(m, w) for m, w in zip(modular, want, strict=True))
    # As a batch (sampling) and one caption at a time, batched back (the cache's entries).
    batch = family.encode_text(comps, list(PROMPTS))
    single = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    for embeds in (batch, single):
        got = caption_list(embeds)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_tiny_tokenizer_has_mistral_control_tokens() -> None:
    tok = build_tiny_ernie_image()["tokenizer"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 11)
    assert tok.convert_tokens_to_ids("[IMG]") == 10 and tok.model_max_length == 2048
    ids = tok("x")["input_ids"]
    assert ids[0] == 1 and len(ids) == 2 and tok("")["input_ids"] == [1]  # BOS, no EOS
    for t in ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"):
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1


def test_sampling_inputs_give_the_pipelines_image() -> None:
    """Our embeddings and CFG scale 4 give the latents ErnieImagePipeline makes from the prompt
    strings at its guidance_scale 4."""
    pipe, family, comps = _pipe_and_family()
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", guidance_scale=4.0,
                  num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                  **COMMON).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                **COMMON).images
    assert torch.equal(ours, theirs)


def test_predict_is_the_velocity_the_pipeline_steps_with() -> None:
    """One pipeline step from pure noise (sigma 1 -> 0) moves the patchified latents by
    -velocity: our `predict` at t = 1, in the autoencoder's layout, is that velocity."""
    from difftune.families.common.bn_vae import patchify, unpatchify

    pipe, family, comps = _pipe_and_family()
    latents = torch.randn(1, 8, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, ["a red circle", "a ring"])
    stepped = pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0),
                   latents=patchify(latents).expand(2, -1, -1, -1).clone(),
                   num_inference_steps=1, **COMMON).images
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents.expand(2, -1, -1, -1), embeds, torch.ones(2),
                                  cond)
    torch.testing.assert_close(unpatchify(stepped), latents - velocity, rtol=0, atol=1e-6)


def test_latents_decode_back_through_the_pipelines_unnormalization() -> None:
    """`encode_images` normalizes with the epsilon the pipeline un-normalizes with: the
    pipeline's decode of our latents is the autoencoder's decode of the raw latents."""
    _, family, comps = _pipe_and_family()
    vae = comps.vae
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    ours = family.encode_images(comps, pixels)
    from difftune.families.common.bn_vae import patchify, unpatchify

    z = patchify(ours)
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    raw = unpatchify(z * torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5) + mean)
    torch.testing.assert_close(raw, vae.encode(pixels).latent_dist.mode(), rtol=0, atol=1e-5)


def test_released_config_builds_on_meta() -> None:
    from diffusers import ErnieImageTransformer2DModel
    from transformers import Ministral3Config, Ministral3Model

    from difftune.families.ernie_image.files import TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG

    with torch.device("meta"):
        transformer = ErnieImageTransformer2DModel(**TRANSFORMER_CONFIG)
        encoder = Ministral3Model(Ministral3Config(**TEXT_ENCODER_CONFIG))
    n_dit = sum(p.numel() for p in transformer.parameters())
    n_te = sum(p.numel() for p in encoder.parameters())
    assert 8.0e9 < n_dit < 8.1e9, n_dit  # ERNIE-Image's "8B" transformer
    assert 3.4e9 < n_te < 3.5e9, n_te  # Ministral 3 3B's language model
    spec = families.spec("ernie_image").sizes[0]
    assert round(n_dit / 1e9, 2) == spec.denoiser and round(n_te / 1e9, 2) == spec.encoders


def test_other_trainers_lora_files_read_as_diffusers() -> None:
    """`--init-lora` reads ERNIE-Image LoRAs as other trainers write them: ai-toolkit's
    `diffusion_model.` PEFT keys, PEFT's `base_model.model.`, kohya-style `lora_unet_` and
    OneTrainer's older files (diffusers' module names with `lora_down`/`lora_up` and `.alpha`,
    which ErnieImagePipeline.load_lora_weights refuses: its keys must all contain "lora")."""
    import pytest

    pipe, family, comps = _pipe_and_family()
    module = "layers.1.self_attention.to_q"
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    want = {f"transformer.{module}.lora_A.weight": a, f"transformer.{module}.lora_B.weight": b}
    files = {
        "ai-toolkit": ({f"diffusion_model.{module}.lora_A.weight": a,
                        f"diffusion_model.{module}.lora_B.weight": b}, {}),
        "peft": ({f"base_model.model.{module}.lora_A.weight": a,
                  f"base_model.model.{module}.lora_B.weight": b}, {}),
        "kohya": ({f"lora_unet_{module.replace('.', '_')}.lora_down.weight": a,
                   f"lora_unet_{module.replace('.', '_')}.lora_up.weight": b,
                   f"lora_unet_{module.replace('.', '_')}.alpha": torch.tensor(2.0)},
                  {f"transformer.{module}": 2.0}),
        "onetrainer": ({f"transformer.{module}.lora_down.weight": a,
                        f"transformer.{module}.lora_up.weight": b,
                        f"transformer.{module}.alpha": torch.tensor(2.0)},
                       {f"transformer.{module}": 2.0}),
    }
    for name, (tensors, alphas) in files.items():
        assert family.lora_from_format(comps, tensors) == (want, alphas), name
    with pytest.raises(ValueError, match="Invalid LoRA checkpoint"):
        pipe.load_lora_weights(files["onetrainer"][0])
