"""Load Krea 2 from local files only: a diffusers folder and/or single files.

`model.path` is a diffusers folder in the layout Krea2Pipeline.save_pretrained writes
(transformer/, vae/ (AutoencoderKLQwenImage), text_encoder/ (Qwen3VLModel), tokenizer/,
scheduler/, model_index.json with `text_encoder_select_layers` and `is_distilled`).
`model.transformer`, `model.vae` and `model.text_encoder` are single .safetensors files as
ComfyUI users keep them (see `krea2.single`); a single file overrides the folder's component,
and the tokenizer always comes from the folder. Weights are read through safetensors only; a
missing or wrong file raises `ModelFileError` naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.folders import check_folder, from_folder
from difftune.families.common.transformer_folder import FolderLayout, load_components
from difftune.families.krea2.spec import LAYERS

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
WHAT = "Krea 2"
# Krea2Pipeline's schedule: the resolution-aware exponential time shift, mu from the image
# token count between base_shift at 256 and max_shift at 6400 tokens (the pipeline's documented
# scheduler settings; the distilled checkpoint fixes mu at 1.15 instead).
SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
    "max_image_seq_len": 6400, "time_shift_type": "exponential",
}
# Krea2Pipeline options stored in model_index.json, with the pipeline's defaults.
PIPELINE_DEFAULTS: dict[str, Any] = {"is_distilled": False, "text_encoder_select_layers": None}


def pipeline_options(folder: Path | None) -> dict[str, Any]:
    """`is_distilled` and `text_encoder_select_layers` from the folder's model_index.json
    (the pipeline's defaults where it has none)."""
    options = dict(PIPELINE_DEFAULTS)
    index = folder / "model_index.json" if folder is not None else None
    if index is not None and index.is_file():
        data = json.loads(index.read_text(encoding="utf-8"))
        options.update({k: data[k] for k in PIPELINE_DEFAULTS if data.get(k) is not None})
    taps = options["text_encoder_select_layers"]
    if taps is not None and tuple(taps) != LAYERS:
        raise ModelFileError(
            f"{index} selects text-encoder layers {list(taps)}; difftune encodes captions with "
            f"Krea 2's layers {list(LAYERS)} (the released pipeline's), so the LoRA would learn "
            "a different conditioning: use a folder in the released layout")
    return options


def _folder(cfg: "ModelConfig") -> Path:
    """model.path, which Krea 2 needs for its tokenizer (also with single files)."""
    if cfg.path is None:
        raise ModelFileError("model.family = \"krea2\" reads its Qwen3-VL tokenizer from a "
                             "diffusers folder; set model.path to a folder in the Krea2Pipeline "
                             "layout (text_encoder/, tokenizer/, ...)")
    folder = Path(cfg.path).expanduser()
    if cfg.transformer is None or cfg.vae is None or cfg.text_encoder is None:
        check_folder(folder, WHAT)
    return folder


def _layout() -> FolderLayout:
    """Krea 2's classes and single-file loaders."""
    from diffusers import AutoencoderKLQwenImage, Krea2Transformer2DModel

    from difftune.families.krea2 import single

    return FolderLayout(WHAT, Krea2Transformer2DModel, AutoencoderKLQwenImage,
                        single.load_transformer_file, single.load_vae_file, SCHEDULER_CONFIG)

def load_krea2_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Every component in `dtypes` (single files over the folder's), plus "name",
    "fingerprint" (model_index.json too: it holds the layer taps and schedule) and the
    pipeline options."""
    folder = _folder(cfg)
    index = folder / "model_index.json"
    return {**load_components(cfg, dtypes, folder, _layout(), load_krea2_text_encoders,
                              (index,) if index.is_file() else ()),
            "pipeline_options": pipeline_options(folder)}

def load_krea2_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The Qwen3-VL text encoder alone: `model.text_encoder` if given, else the folder's."""
    from transformers import Qwen3VLModel

    from difftune.families.krea2 import single

    if cfg.text_encoder is not None:
        return {"text_encoder": single.load_text_encoder_file(Path(cfg.text_encoder), dtype)}
    return {"text_encoder": from_folder(Qwen3VLModel, _folder(cfg), "text_encoder", dtype,
                                        WHAT)}


# --- Krea 2's original single-file layout, written for a full fine-tune -----------------------

# diffusers name prefix -> the original's (the first that matches is used).
_PREFIXES = (("final_layer.scale_shift_table", "last.modulation.lin"),
             ("final_layer.norm.weight", "last.norm.scale"), ("final_layer.linear.", "last.linear."),
             ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
             ("txt_in.linear_2.", "txtmlp.3."), ("img_in.", "first."),
             ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
             ("time_mod_proj.", "tproj.1."), ("text_fusion.", "txtfusion."),
             ("transformer_blocks.", "blocks."))
# Inside blocks (transformer and text-fusion ones): diffusers -> original.
_INSIDE = ((".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
           (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
           (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"),
           (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"), (".ff.", ".mlp."),
           (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
           (".scale_shift_table", ".mod.lin"))


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The Krea 2 transformer in its original layout (what ComfyUI keeps and diffusers'
    single-file converter reads): the inverse of that converter's renames, each block's six
    modulation vectors flattened into one tensor as the original stores them."""
    from difftune.files.single import Piece, check_complete

    names, out = list(model.state_dict()), {}
    for name in names:
        src, dst = next(((d, o) for d, o in _PREFIXES if name.startswith(d)), ("", ""))
        new = dst + name[len(src):]
        if src != "final_layer.scale_shift_table":
            for diffusers_name, original in _INSIDE:
                new = new.replace(diffusers_name, original)
        flat = name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table")
        out[new] = Piece((name,), flat=flat)
    return check_complete(out, names, "Krea 2 original")
