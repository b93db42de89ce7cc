"""Load Chroma from local files only: a diffusers folder and/or single files.

Sources, from `ModelConfig`: `path` is a diffusers folder in the layout of lodestones'
Chroma1-HD (transformer, text_encoder, tokenizer, vae, scheduler); `transformer`, `vae` and `t5`
are single .safetensors files as ComfyUI users keep them (Chroma's original layout, as in
`Chroma1-HD.safetensors`, or the diffusers layout; FLUX.1's `ae.safetensors`;
`t5xxl_*.safetensors`). A single file overrides the folder's component; the folder is still
needed for the tokenizer, which no single file carries. Original key names are converted with
diffusers' own single-file converter.

Weights are read only through safetensors: pickle files are refused. Every missing, unsafe or
wrong file raises `ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.autoencoder import load_ae_file
from difftune.families.common.components import load_t5_file
from difftune.families.common.folders import (check_folder, folder_files, from_folder,
                                              model_folder, tokenizers)
from difftune.families.common.bfl import (DYNAMIC_SHIFT_SCHEDULER, bfl_blocks_layout,
                                          transformer_config,
                                          transformer_from_file)
from difftune.families.common.single_file import count_blocks, fingerprint

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

WHAT = "Chroma"
SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
# Chroma1-HD's sampling schedule (its scheduler/scheduler_config.json: FLUX.1-dev's
# resolution-dependent shift, which ChromaPipeline computes from the image sequence length).
SCHEDULER_CONFIG: dict[str, Any] = DYNAMIC_SHIFT_SCHEDULER
# Chroma1-HD's transformer/config.json (diffusers' ChromaTransformer2DModel defaults).
TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "axes_dims_rope": (16, 56, 56), "approximator_num_channels": 64,
    "approximator_hidden_dim": 5120, "approximator_layers": 5,
}
VAE_SCALE = {"scaling_factor": 0.3611, "shift_factor": 0.1159}  # FLUX.1's ae, Chroma's VAE
T5_MAX_LENGTH = 512  # ChromaPipeline's max_sequence_length
_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """ChromaTransformer2DModel config from a diffusers-layout state dict's shapes."""
    try:
        approx_hidden, approx_in = sd["distilled_guidance_layer.in_proj.weight"].shape
        return {**transformer_config(sd),
                "approximator_num_channels": approx_in, "approximator_hidden_dim": approx_hidden,
                "approximator_layers": count_blocks(sd, "distilled_guidance_layer.layers.")}
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a Chroma transformer: tensor {err} is "
                             "missing") from None


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """A Chroma transformer from one safetensors file, original (BFL) or diffusers layout."""
    from diffusers import ChromaTransformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_chroma_transformer_checkpoint_to_diffusers)

    return transformer_from_file(
        path, dtype, "Chroma transformer", _ORIGINAL_PREFIXES,
        lambda sd: convert_chroma_transformer_checkpoint_to_diffusers(dict(sd)),
        lambda sd, where: ChromaTransformer2DModel(**_transformer_config(sd, where)))


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """Chroma's autoencoder (FLUX.1's `ae.safetensors`, or a diffusers-layout file)."""
    return load_ae_file(path, dtype, VAE_SCALE, "Chroma autoencoder")


def _component(folder: Path | None, file: Path | None, sub: str, cls: Any,
               load_file: Any, dtype: torch.dtype) -> tuple[Any, list[Path]]:
    """One weighted component from its single file if given, else from the folder."""
    if file is not None:
        return load_file(Path(file), dtype), [Path(file)]
    assert folder is not None, "config validation guarantees a folder or every file"
    return from_folder(cls, folder, sub, dtype, WHAT), folder_files(folder, [sub])


def _scheduler(folder: Path | None) -> Any:
    """The folder's scheduler, or Chroma1-HD's settings written in code."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if folder is not None and (folder / "scheduler").is_dir():
        return from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, WHAT)
    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def _tokenizer(folder: Path | None) -> Any:
    """The T5 tokenizer from the folder (single files carry none; nothing is downloaded)."""
    from transformers import T5TokenizerFast

    return tokenizers(folder, ("tokenizer",), T5TokenizerFast, WHAT)[0]


def load_chroma_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Load every Chroma component from local files (see the module docstring for sources).

    `dtypes` has the keys "transformer", "text_encoders" and "vae". Returns ChromaPipeline's
    component names plus "t5_max_length", "name" and "fingerprint" (path/size/mtime of every
    weight file, so caches follow the files).
    """
    from diffusers import AutoencoderKL, ChromaTransformer2DModel
    from transformers import T5EncoderModel

    folder = model_folder(cfg)
    if folder is not None:
        check_folder(folder, WHAT)
    tok = _tokenizer(folder)
    transformer, f1 = _component(folder, cfg.transformer, "transformer",
                                 ChromaTransformer2DModel, load_transformer_file,
                                 dtypes["transformer"])
    vae, f2 = _component(folder, cfg.vae, "vae", AutoencoderKL, load_vae_file, dtypes["vae"])
    t5, f3 = _component(folder, cfg.t5, "text_encoder", T5EncoderModel, load_t5_file,
                        dtypes["text_encoders"])
    return {
        "transformer": transformer, "vae": vae, "text_encoder": t5, "tokenizer": tok,
        "scheduler": _scheduler(folder), "t5_max_length": T5_MAX_LENGTH,
        "name": cfg.name or _base_name(folder, cfg.transformer),
        "fingerprint": fingerprint(f1 + f2 + f3),
    }


def load_chroma_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """Only T5 ("text_encoder"), from the same sources as `load_chroma_files`: to reload the
    encoder after it was unloaded after caching."""
    from transformers import T5EncoderModel

    t5, _ = _component(model_folder(cfg), cfg.t5, "text_encoder", T5EncoderModel,
                       load_t5_file, dtype)
    return {"text_encoder": t5}


def _base_name(folder: Path | None, transformer_file: Path | None) -> str:
    """A readable base-model name: the transformer file's or folder's name, else "chroma"."""
    if transformer_file is not None:
        return Path(transformer_file).stem
    if folder is not None:
        return folder.resolve().name
    return "chroma"


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The Chroma transformer in its original (BFL-style) layout, as Chroma1-HD.safetensors
    holds it (ComfyUI, Forge): BFL's block names (`bfl_blocks_layout`), the guidance
    approximator's `in_layer`/`out_layer`/`.scale` names, `txt_in`, `img_in`, `final_layer`."""
    from difftune.files.single import Piece, check_complete

    names = list(model.state_dict())
    out = bfl_blocks_layout(names)
    top = {"context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear",
           "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
           "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj"}
    for i in range(count_blocks(dict.fromkeys(names), "distilled_guidance_layer.layers.")):
        p = f"distilled_guidance_layer.layers.{i}."
        top |= {f"{p}linear_1": f"{p}in_layer", f"{p}linear_2": f"{p}out_layer"}
        out[f"distilled_guidance_layer.norms.{i}.scale"] = Piece(
            (f"distilled_guidance_layer.norms.{i}.weight",))
    for kind in ("weight", "bias"):
        out |= {f"{dst}.{kind}": Piece((f"{src}.{kind}",)) for src, dst in top.items()}
    return check_complete(out, names, "Chroma original")
