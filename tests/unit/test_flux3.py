"""FLUX.3: what difftune trains on equals the modular pipeline's own steps exactly (CPU): the
text encoder step's embeddings (its 80-token windows and padding positions), the transformer
call of its denoise loop, its CFG and its decode; the step-distilled (flow-map) checkpoint is
told apart and trained at target = timestep."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from difftune import families
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.common.bn_vae import patchify
from difftune.families.flux3.tiny import build_tiny_flux3

from ..lora_files import tiny

from .conftest import cpu_policy

SHORT = "a red circle on a blue background"
LONG = "a very long caption " + "with many words " * 8  # over 80 tokens: a 160-token window


def _components(parts: dict[str, Any]) -> tuple[Any, Any]:
    family = families.get("flux3")
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return family, comps


@pytest.fixture(scope="module")
def setup() -> tuple[dict[str, Any], Any, Any]:
    """The tiny text encoder and tokenizer, the family and its components (the session's tiny
    flavor, shared with the other files' FLUX.3 tests)."""
    comps = tiny("flux3")
    parts = {"text_encoder": comps.text_encoders["qwen3vl"],
             "tokenizer": comps.tokenizers["qwen3vl"]}
    return parts, families.get("flux3"), comps


def reference_embeds(parts: dict[str, Any], prompt: str) -> torch.Tensor:
    """Flux3TextEncoderStep's own encoding of `prompt`, through a Qwen3-VL processor over the
    tiny tokenizer (the step's `tokenizer` component is the processor)."""
    from diffusers.modular_pipelines.flux3.encoders import Flux3TextEncoderStep

    from difftune.families.flux3.sampling import processor

    return Flux3TextEncoderStep._get_qwen3_vl_prompt_embeds(
        parts["text_encoder"], processor(parts["tokenizer"]), prompt, device=torch.device("cpu"))


def test_embeddings_equal_the_text_encoder_step_exactly(setup: Any) -> None:
    parts, family, comps = setup
    for prompt, window in ((SHORT, 80), (LONG, 160)):
        want = reference_embeds(parts, prompt)
        got = family.encode_text(comps, [prompt]).tensors["prompt_embeds"]
        assert want.shape == (1, window, 8 * 32)
        assert torch.equal(got, want)
    # A batch is its captions' own windows zero-padded to the longest, as the cache's entries
    # are batched (the transformer takes no mask; batch 1 is the reference exactly).
    batch = family.encode_text(comps, [SHORT, LONG]).tensors["prompt_embeds"]
    assert torch.equal(batch[0, :80], reference_embeds(parts, SHORT)[0])
    assert not batch[0, 80:].any()
    assert torch.equal(batch[1], reference_embeds(parts, LONG)[0])


def test_predict_is_the_velocity_the_pipeline_steps_with(setup: Any) -> None:
    """One step of the modular pipeline from pure noise (sigma 1 -> 0, guidance off) moves
    the latents by -velocity: the transformer call is the pipeline's."""
    parts, family, comps = setup
    latents = torch.randn(1, 8, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, [SHORT])
    cond = Conditioning(1.0, [], [], [])
    velocity = family.predict(comps, latents, embeds, torch.tensor([1.0]), cond)
    from diffusers import ClassifierFreeGuidance

    pipe = family.pipeline(comps).embedded
    pipe.update_components(guider=ClassifierFreeGuidance(enabled=False))
    stepped = pipe(prompt_embeds=embeds.tensors["prompt_embeds"], latents=patchify(latents),
                        height=32, width=32, num_inference_steps=1, output="latents")
    torch.testing.assert_close(stepped, patchify(latents - velocity), rtol=0, atol=1e-6)


def test_cfg_runs_the_negative_pass(setup: Any) -> None:
    """CFG > 1 with a negative prompt changes the image; without one the guider is off."""
    parts, family, comps = setup
    pipe = family.pipeline(comps)
    pos, neg = (family.encode_text(comps, [p]) for p in (SHORT, "blurry"))

    def image(negative: TextEmbeds | None, cfg: float) -> Any:
        return pipe(**family.pipeline_inputs(pos, negative, 1.0, cfg), width=32, height=32,
                    output_type="np", num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0)).images[0]

    plain = image(None, 4.0)
    assert plain.shape == (32, 32, 3)
    assert (image(neg, 1.0) == plain).all()
    assert not (image(neg, 4.0) == plain).all()
    # The whole modular pipeline, its own text encoder step reading the prompt (and "" as the
    # negative under its default CFG 3.5), samples what difftune's embeddings sample.
    own = pipe(prompt=SHORT, width=32, height=32, output_type="np", num_inference_steps=2,
               generator=torch.Generator().manual_seed(0)).images[0]
    assert (own == image(family.encode_text(comps, [""]), 3.5)).all()


def test_distilled_is_told_apart_and_trained_at_its_own_time(setup: Any) -> None:
    """The flow-map transformer: `distilled` says so (train warns), predict passes
    target_timestep = timestep, and sampling uses the distilled pipeline (no guider)."""
    from diffusers import Flux3DistilledModularPipeline

    parts = build_tiny_flux3(flow_map=True)
    family, comps = _components(parts)
    base = setup[2]
    assert family.distilled(comps) and not family.distilled(base)
    assert family.spec.distilled_note
    seen: dict[str, Any] = {}
    comps.denoiser.register_forward_pre_hook(
        lambda m, a, kw: seen.update(kw), with_kwargs=True)
    t = torch.tensor([0.3])
    family.predict(comps, torch.randn(1, 8, 4, 4), family.encode_text(comps, [SHORT]), t,
                   Conditioning(1.0, [], [], []))
    assert torch.equal(seen["target_timestep"], seen["timestep"])
    pipe = family.pipeline(comps)
    assert isinstance(pipe.pipe, Flux3DistilledModularPipeline)
    image = pipe(**family.pipeline_inputs(family.encode_text(comps, [SHORT]), None, 1.0, 3.5),
                 width=32, height=32, output_type="np", num_inference_steps=2).images[0]
    assert image.shape == (32, 32, 3)


def test_lora_files_of_other_trainers_read_back(setup: Any) -> None:
    """--init-lora's reader: the diffusers names, ai-toolkit's (`diffusion_model.<diffusers
    name>`), BFL's original names under `diffusion_model.` and kohya-style `lora_unet_` names
    with `.alpha` all come back as the same diffusers-named LoRA; diffusers' own converter
    reads BFL's block modules to the same names."""
    from diffusers.loaders import Flux3LoraLoaderMixin

    from difftune.families.flux3.files import original_name

    _, family, comps = setup
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    bfl: dict[str, torch.Tensor] = {}
    kohya: dict[str, torch.Tensor] = {}
    for name, layer in comps.denoiser.named_modules():
        if not isinstance(layer, torch.nn.Linear) or name == "norm_out.linear":
            continue  # BFL's final modulation is (shift, scale): not a renaming
        a, b = torch.randn(2, layer.in_features, generator=gen), torch.randn(layer.out_features, 2)
        state |= {f"transformer.{name}.lora_A.weight": a, f"transformer.{name}.lora_B.weight": b}
        bfl_name = original_name(f"{name}.weight").removesuffix(".weight")
        bfl |= {f"diffusion_model.{bfl_name}.lora_A.weight": a,
                f"diffusion_model.{bfl_name}.lora_B.weight": b}
        flat = "lora_unet_" + name.replace(".", "_")
        kohya |= {f"{flat}.lora_down.weight": a, f"{flat}.lora_up.weight": b,
                  f"{flat}.alpha": torch.tensor(2.0)}
    assert "diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight" in bfl
    ai_toolkit = {k.replace("transformer.", "diffusion_model.", 1): v for k, v in state.items()}
    for tensors in (state, ai_toolkit, bfl, kohya):
        got, alphas = family.lora_from_format(comps, tensors)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in got)
        assert set(alphas.values()) <= {2.0}
    theirs = Flux3LoraLoaderMixin.lora_state_dict(dict(bfl))
    blocks = [k for k in state if "blocks." in k]
    assert all(torch.equal(theirs[k], state[k]) for k in blocks)
