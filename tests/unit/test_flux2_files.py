"""FLUX.2 from local files: diffusers folders in the released layouts (the tiny klein and dev
pipelines saved with save_pretrained, the variant read from model_index.json), and the single
files ComfyUI users keep (original-layout transformer converted by diffusers' converter, the
autoencoder in the original and diffusers layouts, `qwen_3_4b`) over a klein folder, each equal
to the tiny model it was written from."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.flux2.files import load_flux2_files
from difftune.families.flux2.tiny import build_tiny_flux2

from .conftest import assert_same_weights
from .layouts import to_ldm_vae

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}
PIPELINES = {"klein": "Flux2KleinPipeline", "dev": "Flux2Pipeline"}
# diffusers name -> BFL's original name (the inverse of diffusers' converter's renames).
RENAMES = (
    ("x_embedder.", "img_in."), ("context_embedder.", "txt_in."),
    ("time_guidance_embed.timestep_embedder.linear_1.", "time_in.in_layer."),
    ("time_guidance_embed.timestep_embedder.linear_2.", "time_in.out_layer."),
    ("time_guidance_embed.guidance_embedder.linear_1.", "guidance_in.in_layer."),
    ("time_guidance_embed.guidance_embedder.linear_2.", "guidance_in.out_layer."),
    ("_modulation_img.linear.", "_modulation_img.lin."),
    ("_modulation_txt.linear.", "_modulation_txt.lin."),
    ("single_stream_modulation.linear.", "single_stream_modulation.lin."),
    ("proj_out.", "final_layer.linear."),
)
DOUBLE = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale",
          "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
          "attn.to_out.0.weight": "img_attn.proj.weight", "ff.linear_in.weight": "img_mlp.0.weight",
          "ff.linear_out.weight": "img_mlp.2.weight",
          "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
          "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
          "attn.to_add_out.weight": "txt_attn.proj.weight",
          "ff_context.linear_in.weight": "txt_mlp.0.weight",
          "ff_context.linear_out.weight": "txt_mlp.2.weight"}
SINGLE = {"attn.to_qkv_mlp_proj.weight": "linear1.weight", "attn.to_out.weight": "linear2.weight",
          "attn.norm_q.weight": "norm.query_norm.scale",
          "attn.norm_k.weight": "norm.key_norm.scale"}


def to_original(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers-layout FLUX.2 transformer state in BFL's layout, as ComfyUI keeps it."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        parts = key.split(".")
        if parts[0] == "transformer_blocks":
            rest, b = ".".join(parts[2:]), f"double_blocks.{parts[1]}."
            if rest.startswith(("attn.to_q.", "attn.add_q_proj.")):
                stream, names = (("img", ("to_q", "to_k", "to_v")) if "to_q" in rest
                                 else ("txt", ("add_q_proj", "add_k_proj", "add_v_proj")))
                fused = torch.cat([sd[key.replace(names[0], n)] for n in names])
                out[f"{b}{stream}_attn.qkv.weight"] = fused
            elif rest in DOUBLE:
                out[b + DOUBLE[rest]] = value
            continue
        if parts[0] == "single_transformer_blocks":
            out[f"single_blocks.{parts[1]}." + SINGLE[".".join(parts[2:])]] = value
            continue
        if key.startswith("norm_out.linear."):
            shift_scale = torch.cat(list(value.chunk(2, dim=0))[::-1])
            out["final_layer.adaLN_modulation.1.weight"] = shift_scale
            continue
        for new, old in RENAMES:
            key = key.replace(new, old)
        out[key] = value
    return {f"model.diffusion_model.{k}": v.clone().contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    import diffusers

    out = {}
    for variant, cls in PIPELINES.items():
        tiny = build_tiny_flux2(variant)
        folder = tmp_path_factory.mktemp(variant) / f"FLUX.2-{variant}"
        getattr(diffusers, cls)(**tiny).save_pretrained(str(folder), safe_serialization=True)
        out[variant] = (tiny, folder)
    tiny, folder = out["klein"]
    files = folder.parent
    save_file(to_original(tiny["transformer"].state_dict()),
              str(files / "flux-2-klein.safetensors"))
    save_file({k: v.contiguous() for k, v in tiny["transformer"].state_dict().items()},
              str(files / "diffusers-transformer.safetensors"))
    vae = tiny["vae"].state_dict()
    n = len(tiny["vae"].config.block_out_channels)
    ldm = to_ldm_vae({k: v for k, v in vae.items() if not k.startswith("bn.")}, n)
    save_file({**ldm, **{k: v.contiguous() for k, v in vae.items() if k.startswith("bn.")}},
              str(files / "flux2-vae.safetensors"))
    save_file({k: v.contiguous() for k, v in vae.items()}, str(files / "diffusers-vae.safetensors"))
    qwen = {k: v.contiguous() for k, v in tiny["text_encoder"].state_dict().items()
            if k != "lm_head.weight"}  # ComfyUI's file: the tied head left out
    save_file(qwen, str(files / "qwen_3_4b.safetensors"))
    return out


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_diffusers_folder(variant: str, saved: dict[str, tuple[dict, Path]]) -> None:
    tiny, folder = saved[variant]
    cfg = ModelConfig(family="flux2", path=folder)
    assert cfg.variant == variant  # from model_index.json
    parts = load_flux2_files(cfg, FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["scheduler"].config.use_dynamic_shifting
    assert parts["tokenizer"].chat_template == tiny["tokenizer"].chat_template


def test_single_files_over_the_folder(saved: dict[str, tuple[dict, Path]]) -> None:
    tiny, folder = saved["klein"]
    files = folder.parent
    for transformer, vae in (("flux-2-klein", "flux2-vae"),
                             ("diffusers-transformer", "diffusers-vae")):
        cfg = ModelConfig(family="flux2", path=folder,
                          transformer=files / f"{transformer}.safetensors",
                          vae=files / f"{vae}.safetensors",
                          text_encoder=files / "qwen_3_4b.safetensors")
        parts = load_flux2_files(cfg, FP32)
        for name in ("transformer", "vae", "text_encoder"):
            assert_same_weights(parts[name], tiny[name])
        assert parts["transformer"].config.axes_dims_rope == (4, 4, 4, 4)


def test_dev_text_encoder_file_and_missing_folder_are_refused(
        saved: dict[str, tuple[dict, Path]]) -> None:
    _, dev = saved["dev"]
    _, klein = saved["klein"]
    cfg = ModelConfig(family="flux2", path=dev, text_encoder=klein.parent / "qwen_3_4b.safetensors")
    with pytest.raises(ModelFileError, match="text_encoder/ folder"):
        load_flux2_files(cfg, FP32)
    # Single files without the folder: refused when the config loads, naming the tokenizer.
    with pytest.raises(ValidationError, match="model.path is not set.*tokenizer/"):
        ModelConfig(family="flux2", transformer=klein.parent / "flux-2-klein.safetensors",
                    vae=klein.parent / "flux2-vae.safetensors")
