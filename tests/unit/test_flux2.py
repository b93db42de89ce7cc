"""FLUX.2 (klein and dev): what difftune trains on equals each pipeline's encode_prompt exactly
(CPU); latents, predict, CFG and guidance match the pipelines; the variant is chosen by config
or by a folder's model_index.json; the released configs build on the meta device."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from difftune import families
from difftune.config import ModelConfig
from difftune.families.base import Conditioning, TextEmbeds
from difftune.families.flux2.tiny import build_tiny_flux2

from .conftest import cpu_policy

PROMPTS = ["a red circle on a blue background, seen from above", "a pink [IMG]ring", ""]
PIPELINES = {"klein": "Flux2KleinPipeline", "dev": "Flux2Pipeline"}


def _setup(variant: str) -> tuple[Any, Any, Any]:
    import diffusers

    parts = build_tiny_flux2(variant)
    pipe = getattr(diffusers, PIPELINES[variant])(
        **{k: parts[k] for k in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")})
    pipe.set_progress_bar_config(disable=True)
    family = families.get("flux2", variant)
    comps = family.components({**parts, "name": "tiny", "fingerprint": "t"},
                              type("Cfg", (), {"name": None})(), cpu_policy())
    return pipe, family, comps


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_embeddings_equal_encode_prompt_exactly(variant: str) -> None:
    pipe, family, comps = _setup(variant)
    want, _ = pipe.encode_prompt(list(PROMPTS), device="cpu")
    batch = family.encode_text(comps, list(PROMPTS)).tensors["prompt_embeds"]
    single = TextEmbeds.cat([family.encode_text(comps, [p]) for p in PROMPTS])
    assert torch.equal(batch, want)
    assert torch.equal(single.tensors["prompt_embeds"], want)
    alone, _ = pipe.encode_prompt(PROMPTS[1], device="cpu")
    assert torch.equal(family.encode_text(comps, [PROMPTS[1]]).tensors["prompt_embeds"], alone)


def test_tiny_tokenizers_carry_the_real_formats() -> None:
    _, _, klein = _setup("klein")
    tok = klein.tokenizers["qwen3"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.pad_token == "<|endoftext|>"
    _, _, dev = _setup("dev")
    tok = dev.tokenizers["mistral3"]
    text = tok.apply_chat_template([{"role": "system", "content": [{"type": "text", "text": "s"}]},
                                    {"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<s>[SYSTEM_PROMPT]s[/SYSTEM_PROMPT][INST]hi[/INST]"


def test_encode_images_is_the_pipelines_normalized_latent() -> None:
    pipe, family, comps = _setup("klein")
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    from difftune.families.flux2.family import patchify

    ours = family.encode_images(comps, pixels)
    assert ours.shape == (2, 8, 4, 4)
    assert torch.equal(patchify(ours), pipe._encode_vae_image(pixels, None))


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_predict_is_the_velocity_the_pipeline_steps_with(variant: str) -> None:
    """One pipeline step from pure noise (sigma 1 -> 0) moves the packed latents by -velocity;
    dev's guidance reaches its embedding as the pipeline passes it."""
    from difftune.families.flux2.family import patchify

    pipe, family, comps = _setup(variant)
    latents = torch.randn(1, 8, 4, 4, generator=torch.Generator().manual_seed(3))
    embeds = family.encode_text(comps, ["a red circle"])
    seen: dict[str, torch.Tensor] = {}

    def grab(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        seen["latents"] = kw["latents"].clone()
        return {}

    pipe(**family.pipeline_inputs(embeds, None, 2.5, 1.0), latents=patchify(latents), height=32,
         width=32, num_inference_steps=1, output_type="latent", callback_on_step_end=grab)
    cond = Conditioning(guidance=2.5, original_sizes=[], crops=[], target_sizes=[])
    with torch.no_grad():
        velocity = family.predict(comps, latents, embeds, torch.ones(1), cond)
    stepped = seen["latents"].permute(0, 2, 1).reshape(1, 32, 2, 2)
    torch.testing.assert_close(stepped, patchify(latents - velocity), rtol=0, atol=1e-6)


def test_klein_cfg_samples_as_the_pipeline_does_with_prompts() -> None:
    """klein's CFG at 4 with a negative prompt: our embeddings give the pipeline's image from
    the prompt strings (whose negative is the empty prompt)."""
    pipe, family, comps = _setup("klein")
    common = {"height": 32, "width": 32, "num_inference_steps": 2, "output_type": "latent"}
    theirs = pipe(prompt="a red circle", guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(0), **common).images
    kwargs = family.pipeline_inputs(family.encode_text(comps, ["a red circle"]),
                                    family.encode_text(comps, [""]), 1.0, 4.0)
    ours = pipe(**kwargs, generator=torch.Generator().manual_seed(0), **common).images
    assert torch.equal(ours, theirs)
    assert kwargs["guidance_scale"] == 4.0
    assert family.pipeline_inputs(TextEmbeds({"prompt_embeds": torch.zeros(1)}), None, 1.0,
                                  1.0)["guidance_scale"] == 1.0


def _folder(tmp_path: Path, pipeline: str) -> Path:
    folder = tmp_path / pipeline
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
    return folder


def test_variant_comes_from_config_folder_or_default(tmp_path: Path) -> None:
    assert ModelConfig(family="flux2", flavor="tiny").variant == "klein"
    assert ModelConfig(family="flux2", flavor="tiny", variant="dev").variant == "dev"
    assert ModelConfig(family="flux2", path=_folder(tmp_path, "Flux2Pipeline")).variant == "dev"
    assert families.get("flux2", "dev").text_encoders[0].name == "mistral3"
    assert families.spec("flux2", "dev").pipeline_class == "Flux2Pipeline"
    assert ModelConfig(family="z_image", flavor="tiny").variant is None


def test_variant_mismatch_and_unknown_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds the 'dev' variant"):
        ModelConfig(family="flux2", variant="klein", path=_folder(tmp_path, "Flux2Pipeline"))
    with pytest.raises(ValueError, match="choose one of 'klein', 'dev'"):
        ModelConfig(family="flux2", flavor="tiny", variant="schnell")
    with pytest.raises(ValueError, match="has no variants"):
        ModelConfig(family="z_image", flavor="tiny", variant="dev")
    with pytest.raises(ValueError, match="no variant of"):
        ModelConfig(family="flux2", path=_folder(tmp_path, "FluxPipeline"))


def test_variant_encoders_drive_config_checks(tmp_path: Path) -> None:
    """adapter.text_encoders is checked against the chosen variant's encoder names."""
    from difftune.config.checks import text_encoder_problems
    from difftune.config.adapter import AdapterConfig

    dev = ModelConfig(family="flux2", flavor="tiny", variant="dev")
    problems = text_encoder_problems(dev, AdapterConfig(text_encoders=["qwen3"]), None)
    assert any("'qwen3' is not a text encoder" in p and "mistral3" in p for p in problems)
    problems = text_encoder_problems(dev, AdapterConfig(text_encoders=["mistral3"]), None)
    assert any("transformer LoRAs only" in p for p in problems)


def test_released_configs_build_on_meta() -> None:
    """The released transformers (arithmetic from their configs: 3.9B klein 4B, 9.1B klein 9B,
    32.2B dev) and klein 4B's Qwen3-4B text encoder build on the meta device."""
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from difftune.families.flux2.files import TRANSFORMER_CONFIGS

    counts = {}
    for name, config in TRANSFORMER_CONFIGS.items():
        with torch.device("meta"):
            model = Flux2Transformer2DModel(**config)
        counts[name] = sum(p.numel() for p in model.parameters())
    assert 3.8e9 < counts["klein-4b"] < 4.0e9
    assert 9.0e9 < counts["klein-9b"] < 9.2e9
    assert 32.1e9 < counts["dev"] < 32.4e9
    with torch.device("meta"):
        qwen = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            tie_word_embeddings=True))
    assert 3.9e9 < sum(p.numel() for p in qwen.parameters()) < 4.1e9
    assert 3 * 2560 == TRANSFORMER_CONFIGS["klein-4b"]["joint_attention_dim"]


def test_kohya_layout_round_trips_and_reads_in_diffusers() -> None:
    """Our kohya file (BFL names, fused qkv) reads back to the same LoRA, and diffusers' own
    FLUX.2 kohya converter loads it into the pipeline with the outputs of the live LoRA."""
    from peft import LoraConfig, get_peft_model_state_dict

    pipe, family, comps = _setup("klein")
    patterns = family.lora_targets("attention_mlp")
    targets = [n for n, _ in pipe.transformer.named_modules()
               if any(re.fullmatch(p, n) for p in patterns)]
    pipe.transformer.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                            init_lora_weights=False))
    state = {f"transformer.{k}": v.detach().clone()
             for k, v in get_peft_model_state_dict(pipe.transformer).items()}
    kohya = family.lora_to_format(comps, state, "kohya", 2, 4.0)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in kohya
    assert "lora_unet_single_blocks_1_linear1.lora_up.weight" in kohya
    back, alphas = family.lora_from_format(comps, kohya)
    assert set(back) == set(state) and set(alphas.values()) == {4.0}  # alpha as trained
    assert all(torch.equal(back[k], state[k]) for k in state)
    common = {"prompt": "a red circle", "height": 32, "width": 32, "num_inference_steps": 2,
              "guidance_scale": 1.0, "output_type": "latent"}
    ours = pipe(generator=torch.Generator().manual_seed(0), **common).images  # the live LoRA
    pipe.transformer.delete_adapters("default")
    pipe.load_lora_weights(dict(kohya), adapter_name="kohya")
    theirs = pipe(generator=torch.Generator().manual_seed(0), **common).images
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_original_layout_means_the_trained_update_in_both_readers() -> None:
    """The default layout (issue 29) over every Linear of dev's transformer: BFL names under
    `diffusion_model.`, no alpha. ComfyUI adds `B @ A` to each BFL weight (its LoRA adapter at
    scale 1, no alpha); those updates, converted by diffusers' own single-file converter
    (fused qkv split, the final modulation's halves swapped), are the trained ones. diffusers'
    LoRA converter reads every module but norm_out.linear as trained (`lora_unread` says so),
    and the file reads back to the same updates."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_flux2_lora_to_diffusers,
    )
    from diffusers.loaders.single_file_utils import (
        convert_flux2_transformer_checkpoint_to_diffusers,
    )

    from difftune.adapters.coverage import unread
    from difftune.adapters.formats import group_modules

    family = families.get("flux2", "dev")
    model = build_tiny_flux2("dev")["transformer"]
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(2, module.in_features,
                                                                     generator=gen)
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 2,
                                                                     generator=gen)
    want = {m: p.delta() for m, p in group_modules(state, 3.0).items()}  # alpha 3, rank 2
    original = family.lora_to_format(None, state, "original", 2, 3.0)
    assert all(k.startswith("diffusion_model.") and k.endswith((".lora_A.weight",
                                                               ".lora_B.weight"))
               for k in original)
    comfy = {k.removeprefix("diffusion_model.").replace(".lora_B.weight", ".weight"):
             v @ original[k.replace("lora_B", "lora_A")]
             for k, v in original.items() if k.endswith(".lora_B.weight")}
    converted = convert_flux2_transformer_checkpoint_to_diffusers(comfy)
    assert {f"transformer.{k.removesuffix('.weight')}" for k in converted} == set(want)
    for key, value in converted.items():
        torch.testing.assert_close(value, want[f"transformer.{key.removesuffix('.weight')}"],
                                   rtol=1e-5, atol=1e-5)
    # no alpha and no metadata: diffusers takes alpha = rank, scale 1
    theirs = group_modules(_convert_non_diffusers_flux2_lora_to_diffusers(dict(original)), 1.0)
    assert set(theirs) == set(want)
    wrong = sorted(m.removeprefix("transformer.") for m, p in theirs.items()
                   if not torch.allclose(p.up @ p.down, want[m], atol=1e-5))
    assert wrong == ["norm_out.linear"]
    assert list(unread(family, "original", [m.removeprefix("transformer.") for m in want])
                ) == ["diffusers"]
    back, alphas = family.lora_from_format(None, original)
    for module, pair in group_modules(back, alphas).items():
        torch.testing.assert_close(pair.delta(), want[module], rtol=1e-5, atol=1e-5)
    # What `check` says ComfyUI skips in each plain layout is what its key map lacks.
    from ..comfy_keymap import unmapped

    modules = [m.removeprefix("transformer.") for m in want]
    for fmt in family.formats:
        tensors = family.lora_to_format(None, state, fmt, 2, 3.0)
        skipped = unread(family, fmt, modules).get("ComfyUI", ([], ""))[0]
        lost = {k.removeprefix("transformer.").rsplit(".", 2)[0]
                for k in unmapped("flux2", list(tensors))}
        assert sorted(lost) == skipped, fmt
