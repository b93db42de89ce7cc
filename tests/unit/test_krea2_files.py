"""Krea 2 from local files: a diffusers folder in the released layout (the tiny pipeline saved
with save_pretrained, distilled flag and layer taps in model_index.json), and the single files
ComfyUI users keep (original-layout transformer, the autoencoder in the Wan or diffusers
layout, Qwen3-VL as transformers or ComfyUI save it) over that folder, each equal to the tiny model it was written
from; the transformer's original names convert as diffusers' own converter reads them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.krea2.files import load_krea2_files
from difftune.families.krea2.keys import ATTENTION
from difftune.families.krea2.tiny import build_tiny_krea2

from .conftest import assert_same_weights

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}
# diffusers name -> the original one (the inverse of diffusers' converter's renames).
PREFIXES = (("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."),
            ("time_embed.linear_2.", "tmlp.2."), ("time_mod_proj.", "tproj.1."),
            ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
            ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."),
            ("transformer_blocks.", "blocks."), ("final_layer.linear.", "last.linear."),
            ("final_layer.norm.weight", "last.norm.scale"),
            ("final_layer.scale_shift_table", "last.modulation.lin"))
PARTS = (*((f".attn.{d}.", f".attn.{o}.") for d, o in ATTENTION.items()),
         (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"),
         (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"), (".ff.", ".mlp."),
         (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
         (".scale_shift_table", ".mod.lin"))


def to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-layout Krea 2 transformer state in the original layout (flat modulation)."""
    out = {}
    for key, value in sd.items():
        for new, old in PREFIXES:
            if key.startswith(new):
                key = old + key[len(new):]
                break
        for new, old in PARTS:
            key = key.replace(new, old)
        if key.startswith("blocks.") and key.endswith(".mod.lin"):
            value = value.reshape(-1)
        out["model.diffusion_model." + key] = value.contiguous()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from diffusers import Krea2Pipeline

    tiny = build_tiny_krea2()
    folder = tmp_path_factory.mktemp("krea2") / "Krea-2-Turbo"
    Krea2Pipeline(**tiny, is_distilled=True).save_pretrained(str(folder), safe_serialization=True)
    files = folder.parent
    save_file(to_original(tiny["transformer"].state_dict()), str(files / "krea2_turbo.safetensors"))
    save_file({k: v.contiguous() for k, v in tiny["vae"].state_dict().items()},
              str(files / "qwen_image_vae.safetensors"))
    te = tiny["text_encoder"].state_dict()
    full = {f"model.{k}": v.contiguous() for k, v in te.items()}
    full["lm_head.weight"] = full["model.language_model.embed_tokens.weight"].clone()
    save_file(full, str(files / "qwen3vl_4b.safetensors"))
    # ComfyUI's layout (comfy/text_encoders/qwen3vl.py Qwen3VL): the language model under
    # `model.`, the vision tower under `visual.`.
    comfy = {f"model.{k.removeprefix('language_model.')}": v.contiguous()
             for k, v in te.items() if k.startswith("language_model.")}
    comfy |= {k: v.contiguous() for k, v in te.items() if k.startswith("visual.")}
    save_file(comfy, str(files / "qwen3vl_4b_comfy.safetensors"))
    return tiny, folder


def _same_text_states(a: torch.nn.Module, b: torch.nn.Module, tok: object) -> None:
    ids = tok(["a red circle"], return_tensors="pt").input_ids  # type: ignore[operator]
    with torch.no_grad():
        sa = a(input_ids=ids, output_hidden_states=True).hidden_states
        sb = b(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(sa) == len(sb) and all(torch.equal(x, y) for x, y in zip(sa, sb))


def test_diffusers_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    parts = load_krea2_files(ModelConfig(family="krea2", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["scheduler"].config.use_dynamic_shifting is True
    assert parts["pipeline_options"]["is_distilled"] is True
    assert tuple(parts["pipeline_options"]["text_encoder_select_layers"]) == (
        2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
    assert len(parts["tokenizer"]("<|im_start|>system\n")["input_ids"]) == 3


@pytest.mark.parametrize("encoder", ["qwen3vl_4b", "qwen3vl_4b_comfy"])
def test_single_files_over_the_folder(saved: tuple[dict, Path], encoder: str) -> None:
    tiny, folder = saved
    cfg = ModelConfig(family="krea2", path=folder,
                      transformer=folder.parent / "krea2_turbo.safetensors",
                      vae=folder.parent / "qwen_image_vae.safetensors",
                      text_encoder=folder.parent / f"{encoder}.safetensors")
    parts = load_krea2_files(cfg, FP32)
    def config(m: torch.nn.Module) -> dict:
        return {k: v for k, v in m.config.items() if not k.startswith("_")}

    assert config(parts["transformer"]) == config(tiny["transformer"])
    for name in ("transformer", "vae"):
        assert_same_weights(parts[name], tiny[name])
    _same_text_states(parts["text_encoder"], tiny["text_encoder"], tiny["tokenizer"])


def test_original_lora_names_are_diffusers_converters(saved: tuple[dict, Path]) -> None:
    """Our original-layout LoRA names map every preset module as diffusers' own converter does."""
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_krea2_lora_to_diffusers)

    from difftune.families.krea2.family import PRESETS
    from difftune.families.krea2.keys import diffusers_names, to_original

    tiny, _ = saved
    modules = [n for n, m in tiny["transformer"].named_modules() if isinstance(m, torch.nn.Linear)
               and any(re.fullmatch(p, n) for p in PRESETS["all_linear"])]
    modules += ["img_in", "time_mod_proj", "text_fusion.projector", "final_layer.linear"]
    state = {f"transformer.{m}.lora_{f}.weight": torch.ones(2, 2) for m in modules for f in "AB"}
    original = to_original(state, rank=2, alpha=2.0)
    assert _convert_non_diffusers_krea2_lora_to_diffusers(dict(original)).keys() == state.keys()
    assert diffusers_names(original)[0].keys() == state.keys()


def test_no_folder_is_refused(saved: tuple[dict, Path]) -> None:
    _, folder = saved
    # Refused when the config loads, naming the folder's tokenizer (no single file holds it).
    with pytest.raises(ValidationError, match="model.path is not set.*tokenizer/"):
        ModelConfig(family="krea2", transformer=folder.parent / "krea2_turbo.safetensors",
                    vae=folder.parent / "qwen_image_vae.safetensors",
                    text_encoder=folder.parent / "qwen3vl_4b.safetensors")


def _wan_names() -> dict[str, str]:
    """diffusers -> original names of the autoencoder's middle, attention, head and quant
    tensors: the literal tables of diffusers' own converter, inverted."""
    import ast
    import inspect
    import textwrap

    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    tree = ast.parse(textwrap.dedent(inspect.getsource(convert_wan_vae_to_diffusers)))
    tables: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and node.keys:
            tables.update(ast.literal_eval(node))
    return {v: k for k, v in tables.items()}


RESIDUAL = (("norm1.gamma", "residual.0.gamma"), ("conv1.", "residual.2."),
            ("norm2.gamma", "residual.3.gamma"), ("conv2.", "residual.6."),
            ("conv_shortcut.", "shortcut."))


def to_wan(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-layout Qwen-Image autoencoder state in the original (Wan 2.1) layout."""
    names = _wan_names()

    def residual(rest: str) -> str:
        for new, old in RESIDUAL:
            if rest.startswith(new):
                return old + rest[len(new):]
        return rest

    out = {}
    for key, value in sd.items():
        name = names.get(key, key)
        if m := re.match(r"(encoder|decoder)\.conv_in\.(.*)", key):
            name = f"{m[1]}.conv1.{m[2]}"
        elif m := re.match(r"encoder\.down_blocks\.(\d+)\.(.*)", key):
            name = f"encoder.downsamples.{m[1]}.{residual(m[2])}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
            name = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{residual(m[3])}"
        elif m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
            name = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        out[name] = value.contiguous()
    return out


def test_autoencoder_in_the_original_wan_layout(tmp_path: Path) -> None:
    """ComfyUI's qwen_image_vae.safetensors layout (Wan 2.1 names), two blocks a level as
    released, loads through diffusers' converter into the same autoencoder."""
    from diffusers import AutoencoderKLQwenImage

    from difftune.families.krea2.single import load_vae_file
    from difftune.families.krea2.tiny import TINY_VAE_CONFIG

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(**{**TINY_VAE_CONFIG, "num_res_blocks": 2})
    wan = to_wan(vae.state_dict())
    assert "encoder.conv1.weight" in wan and not any("down_blocks" in k for k in wan)
    assert not any("mid_block" in k or "norm_out" in k for k in wan)
    save_file(wan, str(tmp_path / "qwen_image_vae.safetensors"))
    assert_same_weights(load_vae_file(tmp_path / "qwen_image_vae.safetensors", torch.float32), vae)


def test_other_layer_taps_are_refused(tmp_path: Path) -> None:
    """A model_index.json that taps other encoder layers than the ones captions are encoded
    with is refused, naming both."""
    import json

    from difftune.families.krea2.files import pipeline_options

    (tmp_path / "model_index.json").write_text(json.dumps(
        {"_class_name": "Krea2Pipeline", "is_distilled": True,
         "text_encoder_select_layers": [1, 2, 3]}))
    with pytest.raises(ModelFileError, match=r"selects text-encoder layers \[1, 2, 3\]"):
        pipeline_options(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"is_distilled": True}))
    assert pipeline_options(tmp_path) == {"is_distilled": True,
                                          "text_encoder_select_layers": None}
