"""Z-Image: what difftune trains on equals ZImagePipeline.encode_prompt exactly (CPU), the tiny
tokenizer carries Qwen3's special tokens and chat format, and the released model's config
builds on the meta device."""

from __future__ import annotations

import torch

from difftune import families
from difftune.families.base import TextEmbeds
from difftune.families.common import text
from difftune.families.z_image.tiny import build_tiny_z_image

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", ""]


def _pipe_and_family() -> tuple[object, object, object]:
    from diffusers import ZImagePipeline

    parts = build_tiny_z_image()
    pipe = ZImagePipeline(**{k: parts[k] for k in
                             ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")})
    family = families.get("z_image")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly() -> None:
    pipe, family, comps = _pipe_and_family()
    spec = family.text_encoders[0]
    want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                 max_sequence_length=spec.max_length)
    # As a batch (sampling) and one caption at a time, batched back (the cache's entries).
    batch = family.encode_text(comps, list(PROMPTS))
    single = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    from difftune.families.z_image.family import caption_list

    for embeds in (batch, single):
        got = caption_list(embeds)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_cache_entries_hold_only_the_captions_tokens() -> None:
    _, family, comps = _pipe_and_family()
    spec = family.text_encoders[0]
    out = text.encode(spec, comps.text_encoders["qwen3"], comps.tokenizers["qwen3"],
                      ["a pink ring"], spec.max_length, True)
    n = len(comps.tokenizers["qwen3"](text.chat_texts(spec, comps.tokenizers["qwen3"],
                                                      ["a pink ring"]))["input_ids"][0])
    assert out["hidden"].shape[1] == n and bool(out["mask"].all())


def test_tiny_tokenizer_has_qwen3_tokens_and_format() -> None:
    tok = build_tiny_z_image()["tokenizer"]
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"):
        assert tok.convert_tokens_to_ids(t) != tok.unk_token_id and len(tok(t)["input_ids"]) == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert chat == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"


def test_released_config_builds_on_meta() -> None:
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from difftune.families.z_image.files import TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG

    with torch.device("meta"):
        transformer = ZImageTransformer2DModel(**TRANSFORMER_CONFIG)
        encoder = Qwen3Model(Qwen3Config(**TEXT_ENCODER_CONFIG))
    n_dit = sum(p.numel() for p in transformer.parameters())
    n_te = sum(p.numel() for p in encoder.parameters())
    assert 6.0e9 < n_dit < 6.3e9, n_dit  # Z-Image's "6B" transformer
    assert 3.9e9 < n_te < 4.1e9, n_te  # Qwen3-4B without its LM head


def test_other_trainers_lora_names_read_as_diffusers() -> None:
    from difftune.families.common.diffusers_layout import diffusers_names

    a, b = torch.ones(4, 8), torch.zeros(8, 4)
    ai_toolkit = {"diffusion_model.layers.0.attention.to_q.lora_A.weight": a,
                  "diffusion_model.layers.0.attention.to_q.lora_B.weight": b}
    state, alphas = diffusers_names(ai_toolkit)
    assert state == {"transformer.layers.0.attention.to_q.lora_A.weight": a,
                     "transformer.layers.0.attention.to_q.lora_B.weight": b} and alphas == {}
    comfy = {"diffusion_model.layers.1.feed_forward.w1.lora_down.weight": a,
             "diffusion_model.layers.1.feed_forward.w1.lora_up.weight": b,
             "diffusion_model.layers.1.feed_forward.w1.alpha": torch.tensor(2.0)}
    state, alphas = diffusers_names(comfy)
    assert set(state) == {"transformer.layers.1.feed_forward.w1.lora_A.weight",
                          "transformer.layers.1.feed_forward.w1.lora_B.weight"}
    assert alphas == {"transformer.layers.1.feed_forward.w1": 2.0}
    ours = {"transformer.layers.0.attention.to_k.lora_A.weight": a}
    assert diffusers_names(ours) == (ours, {})


def test_pipeline_inputs_sample_as_the_pipeline_does_with_prompts() -> None:
    """Our embeddings and CFG scale 4 give the image ZImagePipeline makes from the prompt
    strings with its guidance_scale 3 (pos + 3 (pos - neg) is CFG at scale 4)."""
    pipe, family, comps = _pipe_and_family()
    pipe.set_progress_bar_config(disable=True)
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", guidance_scale=3.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).images
    assert torch.equal(ours, theirs)


def test_predict_is_the_velocity_the_pipeline_steps_with() -> None:
    """One pipeline step from pure noise (sigma 1 -> 0) moves the latents by -velocity: our
    `predict` at t = 1 is that velocity (time flipped, output negated as the pipeline does)."""
    from difftune.families.base import Conditioning

    pipe, family, comps = _pipe_and_family()
    pipe.set_progress_bar_config(disable=True)
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, ["a red circle"])
    stepped = pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0), latents=latents.clone(),
                   height=32, width=32, num_inference_steps=1, output_type="latent").images
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents, embeds, torch.ones(1), cond)
    torch.testing.assert_close(stepped, latents - velocity, rtol=0, atol=1e-6)


def test_cache_key_fields_grow_only_where_decoder_fields_are_set() -> None:
    """Encoders without a chat template or trimming keep the cache-key fields they had before
    those spec fields existed (their disk caches stay valid); Z-Image's Qwen3 adds both."""
    import dataclasses

    from difftune.families.specs import DECODER_FIELDS

    for name in families.names():
        for spec in families.spec(name).text_encoders:
            fields = spec.key_fields()
            old = {k: v for k, v in dataclasses.asdict(spec).items()
                   if k not in DECODER_FIELDS}
            plain = dataclasses.replace(spec, **{k: spec.__dataclass_fields__[k].default
                                                 for k in DECODER_FIELDS})
            if plain == spec:
                assert fields == old, spec.name
    qwen = families.spec("z_image").text_encoders[0].key_fields()
    assert qwen["chat"] == (("enable_thinking", True),) and qwen["trim"] is True
