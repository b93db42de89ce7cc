"""Anima's files: the released config on the meta device (its parameter counts), the single
files ComfyUI users keep read as the components they hold, and the LoRA layouts: the default
(original names) is all in ComfyUI's key map and what diffusers' Anima converter maps back,
and other trainers' files (sd-scripts' `lora_unet_`, ComfyUI's) read back as ours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune import families
from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.anima import files
from difftune.families.anima.tiny import build_tiny_anima

from ..comfy_keymap import unmapped
from ..lora_files import diffusers_lora, linear_modules, tiny

F32 = torch.float32


def test_released_config_builds_on_meta_with_its_parameter_counts() -> None:
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel
    from transformers import Qwen3Config, Qwen3Model

    with torch.device("meta"):
        parts = (CosmosTransformer3DModel(**files.TRANSFORMER_CONFIG),
                 AnimaTextConditioner(**files.CONDITIONER_CONFIG),
                 Qwen3Model(Qwen3Config(**files.TEXT_ENCODER_CONFIG)))
    counts = [sum(p.numel() for p in m.parameters()) for m in parts]
    # Cosmos-Predict2 2B's DiT, Anima's LLM adapter, Qwen3-0.6B.
    assert counts == [1_956_405_248, 134_663_680, 596_049_920]
    size = families.spec("anima").sizes[0]
    t5_table = 32128 * 1024  # the adapter's T5 table, copied as the token encoder
    assert size.denoiser == round(counts[0] / 1e9, 2)
    assert size.encoders == round((counts[1] + counts[2] + t5_table) / 1e9, 2)


def _single_files(tmp: Path) -> tuple[dict, ModelConfig]:
    """The tiny model as ComfyUI's three files (the DiT and its llm_adapter under `net.` in
    the original names, the VAE, Qwen3 as a causal LM's `model.*`) over a tokenizers folder."""
    parts = build_tiny_anima()
    sd = parts["transformer"].state_dict()
    dit = {f"net.{k}": sd[p.sources[0]] for k, p in
           files.single_file_layout(parts["transformer"]).items()}
    dit |= {f"net.llm_adapter.{k}": v for k, v in parts["text_conditioner"].state_dict().items()}
    save_file({k: v.contiguous() for k, v in dit.items()}, str(tmp / "anima.safetensors"))
    save_file(parts["vae"].state_dict(), str(tmp / "vae.safetensors"))
    save_file({f"model.{k}": v for k, v in parts["text_encoder"].state_dict().items()},
              str(tmp / "qwen3.safetensors"))
    for name in ("tokenizer", "t5_tokenizer"):
        parts[name].save_pretrained(str(tmp / "folder" / name))
    cfg = ModelConfig(family="anima", path=tmp / "folder", transformer=tmp / "anima.safetensors",
                      vae=tmp / "vae.safetensors", text_encoder=tmp / "qwen3.safetensors")
    return parts, cfg


def test_comfyui_single_files_load_as_the_components_they_hold(tmp_path: Path) -> None:
    parts, cfg = _single_files(tmp_path)
    loaded = files.load_anima_files(cfg, {"transformer": F32, "vae": F32, "text_encoders": F32})
    for name in ("transformer", "text_conditioner", "vae", "text_encoder", "t5_embedding"):
        want, got = parts[name].state_dict(), loaded[name].state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), name
    again = files.load_anima_text_encoders(cfg, F32)  # the reload after unloading
    assert torch.equal(again["t5_embedding"].embed.weight, parts["t5_embedding"].embed.weight)


def test_a_cosmos_file_without_the_llm_adapter_is_refused(tmp_path: Path) -> None:
    parts = build_tiny_anima()
    save_file(parts["transformer"].state_dict(), str(tmp_path / "cosmos.safetensors"))
    with pytest.raises(ModelFileError, match="no llm_adapter"):
        files.load_transformer_file(tmp_path / "cosmos.safetensors", F32)


def _lora() -> tuple[object, object, dict[str, torch.Tensor]]:
    family, comps = families.get("anima"), tiny("anima")
    return family, comps, diffusers_lora("anima", linear_modules("anima"))


def test_default_layout_is_read_by_comfyui_and_diffusers() -> None:
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_anima_lora_to_diffusers)

    family, comps, state = _lora()
    original = family.lora_to_format(comps, state, family.default_format, 4, 8.0)
    assert all(k.startswith("diffusion_model.") for k in original)
    assert not any(k.endswith(".alpha") for k in original)
    assert unmapped("anima", list(original)) == []
    back = _convert_non_diffusers_anima_lora_to_diffusers(dict(original))
    assert back.keys() == state.keys()  # diffusers' converter maps every name back
    for key, value in state.items():  # the scale 8 / 4 is in the up factors
        assert torch.equal(back[key], value * 2.0 if ".lora_B." in key else value), key


def _spelled(state: dict[str, torch.Tensor], kohya: bool) -> dict[str, torch.Tensor]:
    """A diffusers LoRA as sd-scripts writes it (`lora_unet_<original, underscored>`,
    lora_down/up, alpha) or as ComfyUI's converter of those files does (`diffusion_model.`)."""
    from difftune.families.anima.keys import to_original

    out = {}
    for key, value in state.items():
        module, factor = key.removeprefix("transformer.").rsplit(".", 2)[:2]
        name = to_original(module)
        base = f"lora_unet_{name.replace('.', '_')}" if kohya else f"diffusion_model.{name}"
        tensor = {"lora_A": "lora_down", "lora_B": "lora_up"}[factor] if kohya else factor
        out[f"{base}.{tensor}.weight"] = value
        out[f"{base}.alpha"] = torch.tensor(8.0)
    return out


@pytest.mark.parametrize("kohya", [True, False], ids=["sd-scripts", "comfyui"])
def test_other_trainers_files_read_back_as_ours(kohya: bool) -> None:
    family, comps, state = _lora()
    spelled = _spelled(state, kohya)
    assert unmapped("anima", list(spelled)) == []  # ComfyUI reads both
    got, alphas = family.lora_from_format(comps, spelled)
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    assert set(alphas) == {k.rsplit(".", 2)[0] for k in state} and set(alphas.values()) == {8.0}


def test_a_lora_of_the_llm_adapter_is_refused_in_either_naming() -> None:
    family, comps, state = _lora()
    assert family.lora_refusal(comps, state) is None
    for key in ("diffusion_model.llm_adapter.blocks.0.cross_attn.q_proj.lora_A.weight",
                "text_conditioner.blocks.0.cross_attn.q_proj.lora_A.weight"):
        why = family.lora_refusal(comps, {**state, key: torch.zeros(4, 32)})
        assert why is not None and key.rsplit(".", 2)[0] in why
