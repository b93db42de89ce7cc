"""Anima: what difftune trains on equals the modular pipeline's text steps exactly (CPU):
AnimaTextEncoderStep.encode_prompt then AnimaTextConditioningStep (the LLM adapter), for a
batch and caption by caption, the empty caption included."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from difftune import families
from difftune.families.anima.tiny import build_tiny_anima
from difftune.families.base import TextEmbeds

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", ""]
CPU = torch.device("cpu")


def _reference_and_ours() -> tuple[Any, Any, Any]:
    """The released modular pipeline over the tiny parts, the family, its components."""
    from diffusers.modular_pipelines import AnimaAutoBlocks, AnimaModularPipeline

    parts = build_tiny_anima()
    pipe = AnimaModularPipeline(blocks=AnimaAutoBlocks())
    pipe.update_components(**{k: parts[k] for k in (
        "transformer", "vae", "scheduler", "text_conditioner", "text_encoder", "tokenizer",
        "t5_tokenizer")})
    family = families.get("anima")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def _reference(pipe: Any, prompts: list[str]) -> torch.Tensor:
    """The modular pipeline's conditioned prompt embeddings (its two text steps)."""
    from diffusers.modular_pipelines.anima.before_denoise import AnimaTextConditioningStep
    from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

    o = AnimaTextEncoderStep.encode_prompt(pipe, prompts, prepare_unconditional_embeds=False,
                                           device=CPU, dtype=torch.float32)
    return AnimaTextConditioningStep._condition_prompt_embeds(
        pipe, o["qwen_prompt_embeds"], o["qwen_attention_mask"], o["t5_input_ids"],
        o["t5_attention_mask"], CPU, torch.float32, torch.float32)


def test_embeddings_equal_the_modular_pipelines_text_steps_exactly() -> None:
    pipe, family, comps = _reference_and_ours()
    batch = family.encode_text(comps, list(PROMPTS)).tensors["prompt_embeds"]
    assert torch.equal(batch, _reference(pipe, list(PROMPTS)))
    for prompt in PROMPTS:  # one caption at a time, as cache entries are made
        ours = family.encode_text(comps, [prompt]).tensors["prompt_embeds"]
        assert torch.equal(ours, _reference(pipe, [prompt])), prompt
        assert ours.shape == (1, 512, comps.denoiser.config.text_embed_dim)
    # Entries joined into a batch (the cache's path) equal it to float rounding.
    joined = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    torch.testing.assert_close(joined.tensors["prompt_embeds"], batch)


def test_samples_from_our_embeddings_equal_the_released_pipelines_from_the_prompt(
        capfd: pytest.CaptureFixture[str]) -> None:
    """The sampling pipeline run from difftune's embeddings (the modular blocks after the text
    steps) draws the image AnimaAutoBlocks draws from the prompt, CFG 4 with the empty
    negative prompt, pixel for pixel; and no progress bar of the nested denoise loop prints."""
    _, family, comps = _reference_and_ours()
    pipe = family.pipeline(comps)
    common = {"height": 32, "width": 48, "num_inference_steps": 2, "output_type": "pt"}
    theirs = pipe(prompt="a red circle", guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, [""]), 1.0, 4.0)
    ours = pipe(generator=torch.Generator().manual_seed(0), **kwargs, **common).images
    assert ours.shape == (1, 3, 32, 48) and torch.equal(ours, theirs)
    assert "it/s" not in capfd.readouterr().err
