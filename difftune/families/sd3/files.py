"""Load SD3 / SD3.5 from local files only: a diffusers folder or one original-layout checkpoint.

Folder: `model.path` in the diffusers SD3/3.5 layout (`load_sd3_folder`). Single file:
`model.transformer` is one MMDiT file (`model.diffusion_model.joint_blocks.*`), with or without
bundled `text_encoders.{clip_l,clip_g,t5xxl}.*` and `first_stage_model.*`. Names are converted
with diffusers' own converters; the configs those need are derived here from tensor shapes (the
released models' values where shapes are silent). Missing parts come from `model.vae` /
`model.clip_l` / `model.t5`, else from the `model.path` diffusers folder, which must also hold
the tokenizers (they are not stored in checkpoints and are never downloaded). SD3's CLIP-G has
no single-file setting, so it must be bundled or in the folder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.components import (UNET_PREFIX, VAE_PREFIX, clip_from_state,
                                                 head_width, load_t5_file, load_vae, t5_from_state)
from difftune.families.common.folders import (check_folder, folder_files, from_folder,
                                              from_folder_or_fail, model_folder, tokenizers)
from difftune.families.common.single_file import (assign_state, cast_state, count_blocks,
                                                  fingerprint, missing_error, prefixed,
                                                  read_safetensors)
from difftune.families.sd3.spec import SPEC

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

SD3_ENCODER_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.",
                        "clip_g": "text_encoders.clip_g.transformer.",
                        "t5": "text_encoders.t5xxl.transformer."}
SD3_VAE_SCALE = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
# SD3.5 scheduler_config.json.
SD3_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}
SINGLE_FILES = ("transformer", "vae", "clip_l", "t5")


# ---------------------------------------------------------------------------------------------
# SD3 / SD3.5


def sd3_config(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """SD3Transformer2DModel config from an original-layout MMDiT state dict (prefix removed)."""
    hidden, in_channels, patch, _ = sd["x_embedder.proj.weight"].shape
    ln_q = sd.get("joint_blocks.0.x_block.attn.ln_q.weight")
    head = ln_q.shape[0] if ln_q is not None else head_width(hidden)
    n_layers = count_blocks(sd, "joint_blocks.")
    dual = tuple(i for i in range(n_layers) if f"joint_blocks.{i}.x_block.attn2.qkv.weight" in sd)
    qk_norm = None
    if ln_q is not None:
        qk_norm = "layer_norm" if "joint_blocks.0.x_block.attn.ln_q.bias" in sd else "rms_norm"
    return {
        "sample_size": 128, "patch_size": patch, "in_channels": in_channels,
        "out_channels": sd["final_layer.linear.weight"].shape[0] // (patch * patch),
        "num_layers": n_layers, "attention_head_dim": head, "num_attention_heads": hidden // head,
        "joint_attention_dim": sd["context_embedder.weight"].shape[1],
        "caption_projection_dim": sd["context_embedder.weight"].shape[0],
        "pooled_projection_dim": sd["y_embedder.mlp.0.weight"].shape[1],
        "pos_embed_max_size": math.isqrt(sd["pos_embed"].shape[1]),
        "dual_attention_layers": dual, "qk_norm": qk_norm,
    }


def check_sd3_layout(sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse a checkpoint that is not in the original SD3/3.5 (Stability) layout."""
    if not any(k.startswith(UNET_PREFIX + "joint_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like an SD3/3.5 checkpoint: no "
                             f"{UNET_PREFIX}joint_blocks.* tensors (expected the original "
                             "Stability layout of sd3.5_*.safetensors)")


def load_sd3_transformer(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype) -> Any:
    """The SD3/3.5 MMDiT of a whole-checkpoint state dict, via diffusers' converter."""
    from diffusers import SD3Transformer2DModel
    from diffusers.loaders.single_file_utils import (
        convert_sd3_transformer_checkpoint_to_diffusers,
    )

    mmdit = prefixed(sd, UNET_PREFIX)
    check_sd3_layout(sd, path)
    try:
        config = sd3_config(mmdit)
        converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(mmdit))
    except (KeyError, IndexError, ValueError) as err:
        raise missing_error(path, "an SD3/3.5 transformer", err) from None
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    return assign_state(model, cast_state(converted, dtype), path, "SD3 transformer")


def _sd3_encoder(sd: dict, name: str, build: Callable[[dict], Any], file: Path | None,
                 load_file: Callable[[Path], Any] | None) -> tuple[Any, list[Path]] | None:
    """One SD3 text encoder: bundled in the checkpoint, else its own single file, else None."""
    bundled = prefixed(sd, SD3_ENCODER_PREFIXES[name])
    if bundled:
        return build(bundled), []
    if file is not None and load_file is not None:
        return load_file(Path(file)), [Path(file)]
    return None


def load_sd3_file(cfg: ModelConfig, dtypes: dict[str, torch.dtype],
                  text_only: bool = False) -> dict[str, Any]:
    """Every SD3/3.5 component from `cfg.transformer` (see the module docstring for fallbacks).

    `dtypes` has "transformer", "vae", "text_encoders"; returns StableDiffusion3Pipeline's
    component names plus "name" and "fingerprint". `text_only`: the three text encoders alone
    (to reload them after they were unloaded).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    path, folder = Path(cfg.transformer).expanduser(), model_folder(cfg)
    toks = tokenizers(folder, ("tokenizer", "tokenizer_2", "tokenizer_3"), AutoTokenizer, "SD3")
    sd = read_safetensors(path, "SD3/3.5 checkpoint (original Stability layout)")
    check_sd3_layout(sd, path)
    te = dtypes["text_encoders"]

    def clip(tok: Any, act: str, own_projection: bool) -> Callable[[dict], Any]:
        def build(s: dict) -> Any:
            if not own_projection:  # SD3 feeds CLIP-L's pooled output unprojected
                s = {k: v for k, v in s.items() if k != "text_projection.weight"}
            return clip_from_state(s, path, te, tok, projection=True, act=act)
        return build

    sources = {
        "clip_l": ("text_encoder", CLIPTextModelWithProjection, cfg.clip_l, clip(toks[0], "quick_gelu", False)),
        "clip_g": ("text_encoder_2", CLIPTextModelWithProjection, None, clip(toks[1], "gelu", True)),
        "t5": ("text_encoder_3", T5EncoderModel, cfg.t5, lambda s: t5_from_state(s, path, te)),
    }
    parts: dict[str, Any] = {}
    files = [path]
    for name, (sub, cls, file, build) in sources.items():
        load_file = (lambda p, b=build, n=name: b(read_safetensors(p, f"{n} text encoder"))) \
            if name == "clip_l" else (lambda p: load_t5_file(p, te))
        got = _sd3_encoder(sd, name, build, file, load_file if file is not None else None)
        if got is None:
            hint = SD3_ENCODER_PREFIXES[name] + "*"
            if name == "clip_g":
                hint += "; there is no model.clip_g setting, so use a checkpoint with bundled " \
                        "text encoders or a diffusers folder"
            else:
                hint += f"; or set model.{name}"
            got = from_folder_or_fail(folder, sub, cls, te, "SD3", path, hint)
        parts[sub] = got[0]
        files += got[1]
    if text_only:
        return parts
    transformer = load_sd3_transformer(sd, path, dtypes["transformer"])
    vae, more = load_vae(cfg.vae, sd, path, dtypes["vae"], SD3_VAE_SCALE) or \
        from_folder_or_fail(folder, "vae", AutoencoderKL, dtypes["vae"], "SD3", path,
                            VAE_PREFIX + "*; or set model.vae")
    parts.update(transformer=transformer, vae=vae, tokenizer=toks[0], tokenizer_2=toks[1],
                 tokenizer_3=toks[2],
                 scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG),
                 name=path.stem, fingerprint=fingerprint(files + more))
    return parts


# ---------------------------------------------------------------------------------------------
# Diffusers folder


def _encoder_class(te_sub: str) -> Any:
    """T5 for the third text encoder, CLIP with projection for the two others."""
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    return T5EncoderModel if te_sub == "text_encoder_3" else CLIPTextModelWithProjection


def load_sd3_folder(folder: Path, dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """All components of a diffusers SD3/3.5 folder, keyed as StableDiffusion3Pipeline names them.

    Local files and safetensors only (`folders.from_folder`); the fingerprint covers every
    component file so cache keys change when any of them does.
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
    )
    from transformers import AutoTokenizer

    what = "SD3"
    check_folder(folder, what)
    te_dtype = dtypes["text_encoders"]
    parts: dict[str, Any] = {
        "transformer": from_folder(SD3Transformer2DModel, folder, "transformer",
                                   dtypes["transformer"], what),
        "vae": from_folder(AutoencoderKL, folder, "vae", dtypes["vae"], what),
        "scheduler": from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, what),
    }
    for _, te_sub, tok_sub in SPEC.encoder_parts:
        parts[te_sub] = from_folder(_encoder_class(te_sub), folder, te_sub, te_dtype, what)
        parts[tok_sub] = from_folder(AutoTokenizer, folder, tok_sub, None, what)
    subs = ["transformer", "vae"] + [te for _, te, _ in SPEC.encoder_parts]
    parts.update(name=str(folder.name), fingerprint=fingerprint(folder_files(folder, subs)))
    return parts


def load_sd3_folder_text_encoders(folder: Path, dtype: torch.dtype) -> dict[str, Any]:
    """Only the three text encoders of a diffusers SD3 folder (a reload after unloading)."""
    return {te: from_folder(_encoder_class(te), folder, te, dtype, "SD3")
            for _, te, _ in SPEC.encoder_parts}


def source_parts(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """A checkpoint's parts or a diffusers folder's; single files without the checkpoint are
    refused clearly."""
    if cfg.transformer is not None:  # one Stability-layout checkpoint (+ tokenizers in path)
        return load_sd3_file(cfg, dtypes)
    given = [k for k in SINGLE_FILES if getattr(cfg, k) is not None]
    if given:
        raise ModelFileError(
            f"model.{', model.'.join(given)} given without model.transformer: SD3 single files "
            "start from the checkpoint (model.transformer); set it, or use only model.path")
    assert cfg.path is not None  # ModelConfig guarantees a source
    return load_sd3_folder(Path(cfg.path), dtypes)


def text_parts(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """The three text encoders alone, from the checkpoint or the folder (a reload)."""
    if cfg.transformer is not None:
        return load_sd3_file(cfg, {"text_encoders": dtype}, text_only=True)
    assert cfg.path is not None  # ModelConfig guarantees a source
    return load_sd3_folder_text_encoders(Path(cfg.path), dtype)


# --- the original (MMDiT) checkpoint layout, written for a full fine-tune -------------------

_MMDIT_TOP = {"pos_embed.proj": "x_embedder.proj",
              "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
              "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
              "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
              "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
              "context_embedder": "context_embedder", "proj_out": "final_layer.linear"}
_MMDIT_BLOCK = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
                "attn2.to_out.0": "x_block.attn2.proj", "attn.norm_q": "x_block.attn.ln_q",
                "attn.norm_k": "x_block.attn.ln_k", "attn.norm_added_q": "context_block.attn.ln_q",
                "attn.norm_added_k": "context_block.attn.ln_k",
                "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
                "norm1.linear": "x_block.adaLN_modulation.1",
                "norm1_context.linear": "context_block.adaLN_modulation.1",
                "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
                "ff_context.net.0.proj": "context_block.mlp.fc1",
                "ff_context.net.2": "context_block.mlp.fc2"}
# Fused q, k, v: the diffusers names' stem -> the MMDiT tensor.
_MMDIT_QKV = (("attn.to_{}", "x_block.attn.qkv"), ("attn.add_{}_proj", "context_block.attn.qkv"),
              ("attn2.to_{}", "x_block.attn2.qkv"))


def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The SD3/3.5 transformer in Stability's MMDiT layout (`model.diffusion_model.
    joint_blocks...`, as sd3.5_large.safetensors holds it): fused qkv, and the (shift, scale)
    order of the final layer's modulation and of the last block's context modulation."""
    from difftune.files.single import Piece, check_complete

    names, last = list(model.state_dict()), model.config.num_layers - 1
    out: dict[str, Piece] = {"pos_embed": Piece(("pos_embed.pos_embed",))}
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = Piece((f"norm_out.linear.{kind}",), True)
        out |= {f"{dst}.{kind}": Piece((f"{src}.{kind}",)) for src, dst in _MMDIT_TOP.items()
                if f"{src}.{kind}" in names}
    for i in range(model.config.num_layers):
        p, b = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for src, dst in _MMDIT_BLOCK.items():
            for kind in ("weight", "bias"):
                if f"{p}{src}.{kind}" in names:
                    swap = src == "norm1_context.linear" and i == last  # context_pre_only
                    out[f"{b}{dst}.{kind}"] = Piece((f"{p}{src}.{kind}",), swap)
        for stem, dst in _MMDIT_QKV:
            for kind in ("weight", "bias"):
                parts = tuple(f"{p}{stem.format(x)}.{kind}" for x in "qkv")
                if parts[0] in names:
                    out[f"{b}{dst}.{kind}"] = Piece(parts)
    layout = {UNET_PREFIX + k: v for k, v in out.items()}
    return check_complete(layout, names, "SD3 MMDiT")
