"""Krea 2: what difftune trains on equals Krea2Pipeline.encode_prompt exactly (CPU), the tiny
tokenizer gives the real prompt layout (34-token prefix, 5-token suffix), predict and CFG are
the pipeline's, the distilled flag picks the pipeline's fixed shift, and the released model's
config builds on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from difftune import families
from difftune.config import ModelConfig, PrecisionConfig
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.krea2.tiny import build_tiny_krea2
from difftune.precision.policy import PrecisionPolicy

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background", "a pink ring", "",
           "a very long caption " + "with many words " * 12]


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, Any]:
    """The pipeline over the tiny parts, the family and its components (same modules)."""
    from diffusers import Krea2Pipeline

    parts = build_tiny_krea2()
    pipe = Krea2Pipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    family = families.get("krea2")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly(setup: tuple[Any, Any, Any]) -> None:
    pipe, family, comps = setup
    want, want_mask = pipe.encode_prompt(list(PROMPTS), device="cpu")
    assert want.shape[1:3] == (512, 12)
    # As a batch (sampling) and one caption at a time, batched back (the cache's entries).
    batch = family.encode_text(comps, list(PROMPTS))
    single = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    for embeds in (batch, single):
        assert torch.equal(embeds.tensors["prompt_embeds"], want)
        assert torch.equal(embeds.tensors["prompt_embeds_mask"], want_mask)
    alone, alone_mask = pipe.encode_prompt(PROMPTS[1], device="cpu")
    one = family.encode_text(comps, [PROMPTS[1]])
    assert torch.equal(one.tensors["prompt_embeds"], alone)
    assert torch.equal(one.tensors["prompt_embeds_mask"], alone_mask)


def test_tiny_tokenizer_has_the_real_prompt_layout() -> None:
    from difftune.families.krea2.spec import PREFIX, PREFIX_TOKENS, SUFFIX, SUFFIX_TOKENS

    tok = build_tiny_krea2()["tokenizer"]
    for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>",
              "<|image_pad|>"):
        assert len(tok(t)["input_ids"]) == 1 and tok.convert_ids_to_tokens(
            tok(t)["input_ids"])[0] == t
    assert len(tok(PREFIX)["input_ids"]) == PREFIX_TOKENS == 34
    assert len(tok(SUFFIX)["input_ids"]) == SUFFIX_TOKENS == 5
    assert tok.pad_token == "<|endoftext|>" and tok.padding_side == "right"
    chat = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_predict_is_the_velocity_the_pipeline_steps_with(setup: tuple[Any, Any, Any]) -> None:
    """One pipeline step from pure noise (sigma 1 -> 0) moves the latents by -velocity."""
    from difftune.families.common.latents import pack

    pipe, family, comps = setup
    latents = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, ["a red circle"])
    stepped = pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0), latents=pack(latents),
                   height=32, width=32, num_inference_steps=1, output_type="latent").images
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents, embeds, torch.ones(1), cond)
    torch.testing.assert_close(stepped, pack(latents - velocity), rtol=0, atol=1e-6)


def test_cfg_samples_as_the_pipeline_does_with_prompts(setup: tuple[Any, Any, Any]) -> None:
    """Our embeddings and CFG scale 4 give the image Krea2Pipeline makes from the prompt
    strings with its guidance_scale 3 (pos + 3 (pos - neg) is CFG at scale 4)."""
    pipe, family, comps = setup
    common = {"height": 32, "width": 48, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", guidance_scale=3.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).images
    assert torch.equal(ours, theirs)


def test_pipeline_carries_the_loaded_models_options(setup: tuple[Any, Any, Any]) -> None:
    """The distilled flag (fixed mu 1.15) and layer taps of the loaded model reach the
    sampling pipeline; the two schedules differ at a size where the resolution mu is not 1.15."""
    import copy

    _, family, comps = setup
    assert family.pipeline(comps).config.is_distilled is False
    distilled = copy.copy(comps)
    distilled.extras = {"pipeline_options": {"is_distilled": True,
                                             "text_encoder_select_layers": (1, 2) * 6}}
    pipe = family.pipeline(distilled)
    assert pipe.config.is_distilled is True
    assert pipe.text_encoder_select_layers == (1, 2) * 6
    sigmas: dict[bool, list[float]] = {}
    for flag, p in ((False, family.pipeline(comps)), (True, pipe)):
        p.scheduler = copy.deepcopy(p.scheduler)
        p(prompt_embeds=torch.zeros(1, 4, 12, 32), prompt_embeds_mask=torch.ones(1, 4).bool(),
          guidance_scale=0.0, height=32, width=32, num_inference_steps=2, output_type="latent")
        sigmas[flag] = p.scheduler.sigmas.tolist()
    assert sigmas[False] != sigmas[True]


def test_released_config_builds_on_meta() -> None:
    from diffusers import Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from difftune.families.krea2.released import TEXT_CONFIG, TRANSFORMER_CONFIG, VISION_CONFIG

    with torch.device("meta"):
        transformer = Krea2Transformer2DModel(**TRANSFORMER_CONFIG)
        encoder = Qwen3VLModel(Qwen3VLConfig(text_config=TEXT_CONFIG,
                                             vision_config=VISION_CONFIG))
    n_dit = sum(p.numel() for p in transformer.parameters())
    n_text = sum(p.numel() for p in encoder.language_model.parameters())
    n_vision = sum(p.numel() for p in encoder.visual.parameters())
    assert 12.0e9 < n_dit < 13.0e9, n_dit
    assert 3.9e9 < n_text < 4.1e9, n_text  # Qwen3-VL-4B's language model (no LM head)
    assert 0.35e9 < n_vision < 0.45e9, n_vision


def test_cache_key_fields_name_the_prompt_layout() -> None:
    """The layout fields enter Krea 2's cache key (a changed template or layer list is a new
    entry); the unset chat/trim fields stay out."""
    fields = families.spec("krea2").text_encoders[0].key_fields()
    assert fields["template"].endswith("<|im_start|>user\n{}") and fields["drop"] == 34
    assert fields["suffix"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert len(fields["layers"]) == 12 and fields["stack"] == "axis"
    assert fields["valid_positions"] == 3 and "chat" not in fields and "trim" not in fields


def test_flux_shift_follows_the_pipeline_for_base_and_distilled_models() -> None:
    """Base: mu from the scheduler's constants (256 -> 6400 tokens, 0.5 -> 1.15, as
    Krea2Pipeline's calculate_shift); distilled: the pipeline's fixed mu 1.15."""
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    from difftune.config import TrainConfig
    from difftune.families.krea2.family import DISTILLED_MU

    family = families.get("krea2")
    comps = family.load(ModelConfig(family="krea2", flavor="tiny"),
                        PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu")))
    cfg = TrainConfig(timesteps="flux_shift")
    base = family.objective(comps, cfg).dynamic
    assert base.mu(1024) == pytest.approx(calculate_shift(1024, 256, 6400, 0.5, 1.15))
    comps.extras["pipeline_options"]["is_distilled"] = True
    distilled = family.objective(comps, cfg).dynamic
    assert distilled.mu(256) == distilled.mu(6400) == DISTILLED_MU
