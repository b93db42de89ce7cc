"""Wan: what difftune trains on equals WanPipeline.encode_prompt exactly (CPU), its transformer
gets from `predict` what the pipeline gives it, the 2.2 low-noise expert samples alone, the
training shift is the scheduler's, and the released models' configs build on the meta device
with the parameter counts the memory estimate reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from difftune import families
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.wan.family import padded_prompt
from difftune.families.wan.tiny import build_tiny_wan

from .conftest import cpu_policy

# Whitespace runs and an HTML entity: WanPipeline's prompt_clean tidies them first.
PROMPTS = ["a red circle on a blue background", "a  pink\tring &amp; a square ", ""]
PARTS = ("transformer", "transformer_2", "vae", "text_encoder", "tokenizer", "scheduler")


def _pipe_and_family(variant: str | None = None) -> tuple[Any, Any, Any]:
    """The tiny model's own WanPipeline (as its builder keys it), the family and its
    components."""
    from diffusers import WanPipeline

    parts = build_tiny_wan(variant)
    family = families.get("wan", variant)
    pipe = WanPipeline(**{k: parts[k] for k in PARTS},
                       boundary_ratio=1.0 if parts["transformer"] is None else None)
    pipe.set_progress_bar_config(disable=True)
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


def test_embeddings_equal_encode_prompt_exactly() -> None:
    pipe, family, comps = _pipe_and_family()
    want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu", do_classifier_free_guidance=False,
                                 max_sequence_length=512)
    # As a batch (sampling) and one caption at a time, batched back (the cache's entries).
    batch = family.encode_text(comps, list(PROMPTS))
    single = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    for embeds in (batch, single):
        got = padded_prompt(embeds, 512)
        assert got.shape == want.shape == (3, 512, 32)
        assert torch.equal(got, want)


def test_pipeline_inputs_sample_as_the_pipeline_does_with_prompts() -> None:
    """Our embeddings with CFG 4 give the latents WanPipeline makes from the prompt strings."""
    pipe, family, comps = _pipe_and_family()
    common = {"height": 32, "width": 48, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", negative_prompt="blurry", guidance_scale=4.0,
                  num_frames=1, generator=torch.Generator().manual_seed(0), **common).frames
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, ["blurry"]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).frames
    assert theirs.shape == (1, 16, 1, 4, 6) and torch.equal(ours, theirs)


def _calls(model: torch.nn.Module) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Every call of `model` from now on: (its keyword arguments, its output)."""
    calls: list[tuple[dict[str, Any], torch.Tensor]] = []
    model.register_forward_hook(lambda m, args, kwargs, out: calls.append((kwargs, out[0])),
                                with_kwargs=True)
    return calls


@pytest.mark.parametrize("variant", ["2.1-t2v-1.3b", "2.2-t2v-a14b-low"])
def test_predict_is_what_the_pipeline_gives_its_transformer(variant: str) -> None:
    """The first denoising step's transformer call: our `predict` on its latents at
    t = timestep / 1000, with our embeddings, returns the same velocity (the 2.2 expert is
    the pipeline's transformer_2, run at every step)."""
    pipe, family, comps = _pipe_and_family(variant)
    calls = _calls(comps.denoiser)
    embeds = family.encode_text(comps, ["a red circle"])
    pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0), height=32, width=32,
         num_inference_steps=3, output_type="latent", generator=torch.Generator().manual_seed(1))
    assert len(calls) == 3  # one call a step, all of them the trained transformer's
    kwargs, out = calls[0]
    cond = Conditioning(guidance=1.0, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        ours = family.predict(comps, kwargs["hidden_states"].squeeze(2), embeds,
                              kwargs["timestep"].float() / 1000, cond)
    torch.testing.assert_close(ours, out.squeeze(2), rtol=0, atol=1e-6)


def test_low_noise_expert_is_the_pipelines_transformer_2() -> None:
    _, family, comps = _pipe_and_family("2.2-t2v-a14b-low")
    pipe = family.pipeline(comps)
    assert pipe.transformer is None and pipe.transformer_2 is comps.denoiser
    assert pipe.config.boundary_ratio == 1.0


def test_flux_shift_trains_at_the_schedulers_flow_shift() -> None:
    """UniPC over flow sigmas shifts by its fixed flow_shift (3) at every size; the objective
    built from the loaded scheduler draws `flux_shift` times with that shift."""
    import math

    _, family, comps = _pipe_and_family()
    cfg = type("Train", (), {"timesteps": "flux_shift"})()
    dynamic = family.objective(comps, cfg).dynamic
    for tokens in (16, 4096, 20000):
        assert math.exp(dynamic.mu(tokens)) == pytest.approx(3.0)


@pytest.mark.parametrize("variant, dim, ffn, heads, layers", [
    ("2.1-t2v-1.3b", 1536, 8960, 12, 30), ("2.1-t2v-14b", 5120, 13824, 40, 40),
    ("2.2-t2v-a14b-low", 5120, 13824, 40, 40)])
def test_released_configs_build_on_meta_with_the_declared_sizes(
        variant: str, dim: int, ffn: int, heads: int, layers: int) -> None:
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from difftune.families.wan.files import TEXT_ENCODER_CONFIG, TRANSFORMER_CONFIG

    size = families.spec("wan", variant).sizes[0]
    with torch.device("meta"):
        transformer = WanTransformer3DModel(**{**TRANSFORMER_CONFIG, "ffn_dim": ffn,
                                               "num_attention_heads": heads,
                                               "num_layers": layers})
        encoder = UMT5EncoderModel(UMT5Config(**TEXT_ENCODER_CONFIG))
    n_dit = sum(p.numel() for p in transformer.parameters()) / 1e9
    n_te = sum(p.numel() for p in encoder.parameters()) / 1e9
    assert n_dit == pytest.approx(size.denoiser, abs=0.01)
    assert n_te == pytest.approx(size.encoders, abs=0.01)
    assert (size.layers, size.width) == (layers, dim) and transformer.config.num_layers == layers


def test_model_spec_names_the_variant() -> None:
    """LoRA files say which Wan they were trained on (model sites filter by it)."""
    for variant, arch, base in (("2.1-t2v-14b", "wan-2.1-t2v-14b", "wan21"),
                                ("2.2-t2v-a14b-low", "wan-2.2-t2v-a14b-low-noise", "wan22")):
        spec = families.get("wan", variant).model_spec(None)
        assert (spec.architecture, spec.base_version) == (arch, base)


def test_wan21_i2v_size_counts_its_clip_vision_encoder_with_the_encoders() -> None:
    """Wan 2.1 I2V's estimate holds its CLIP vision encoder (the published ViT-H/14 config,
    built on the meta device) beside UMT5: both are on the accelerator while caching."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from difftune.families.wan.clip_vision import CONFIG as CLIP_VISION_CONFIG, config
    from difftune.families.wan.spec import UMT5_SIZE

    with torch.device("meta"):
        clip = CLIPVisionModel(CLIPVisionConfig(**CLIP_VISION_CONFIG))
    count = sum(p.numel() for p in clip.parameters())
    assert count == 630_766_080  # ViT-H/14's vision tower (its projection left out)
    # ComfyUI's clip_vision_h.safetensors, whose shapes give the published config back
    assert config(clip.state_dict(), Path("clip_vision_h.safetensors")) == CLIP_VISION_CONFIG
    assert families.spec("wan", "2.1-i2v-14b").sizes[0].encoders == pytest.approx(
        UMT5_SIZE + count / 1e9, abs=0.01)  # UMT5's count: the released configs' test above
