"""Load SDXL and SD3/3.5 from single original-layout checkpoints, offline, safetensors only.

SDXL: `model.transformer` is one SGM-layout file such as `sd_xl_base_1.0.safetensors`
(`model.diffusion_model.*` UNet, `first_stage_model.*` VAE, `conditioner.embedders.0.
transformer.*` CLIP-L, `conditioner.embedders.1.model.*` OpenCLIP-G).
SD3/3.5: `model.transformer` is one MMDiT file (`model.diffusion_model.joint_blocks.*`), with
or without bundled `text_encoders.{clip_l,clip_g,t5xxl}.*` and `first_stage_model.*`.

Names are converted with diffusers' own converters; the configs those need are derived here from
tensor shapes (the released models' values where shapes are silent: head width 64, 32 norm
groups, time-id width 256, VAE scaling). Missing parts come from `model.vae` / `model.clip_l` /
`model.t5`, else from the `model.path` diffusers folder, which must also hold the tokenizers
(they are not stored in checkpoints and are never downloaded). SD3's CLIP-G has no single-file
setting, so it must be bundled or in the folder.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.component_files import (
    _vae_config,
    assign_state,
    cast_state,
    count_blocks,
    fingerprint,
    load_t5_file,
    read_safetensors,
    strip_prefix,
    t5_from_state,
)
from difftune.families.folders import folder_files, from_folder

if TYPE_CHECKING:
    from difftune.config import ModelConfig

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SDXL_CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
SDXL_CLIP_G_PREFIX = "conditioner.embedders.1.model."
SD3_ENCODER_PREFIXES = {"clip_l": "text_encoders.clip_l.transformer.",
                        "clip_g": "text_encoders.clip_g.transformer.",
                        "t5": "text_encoders.t5xxl.transformer."}
SDXL_VAE_SCALE = {"scaling_factor": 0.13025, "shift_factor": None}
SD3_VAE_SCALE = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
SDXL_TIME_ID_WIDTH = 256  # SDXL-base's addition_time_embed_dim, used when CLIP-G is not bundled
SD3_SCHEDULER_CONFIG: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}

# ---------------------------------------------------------------------------------------------
# Shape rules for what the weights do not record


def norm_groups(width: int) -> int:
    """GroupNorm groups: the released models' 32, or 8 for the narrow test models (tiny flavors)."""
    return 32 if width >= 128 else min(8, width)


def head_width(width: int) -> int:
    """Attention head width: 64 in SDXL, SD3 and both CLIPs; 16 in the narrow tiny models."""
    return 64 if width >= 320 else 16


def _prefixed(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, with it removed."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _missing(path: Path, what: str, err: Exception) -> ModelFileError:
    """The error for a checkpoint lacking a tensor its layout needs."""
    return ModelFileError(f"{path} does not look like {what}: tensor {err} is missing or "
                          "misshapen; expected an original-layout (SGM/Stability) checkpoint")


# ---------------------------------------------------------------------------------------------
# SDXL UNet


def _level_starts(n_levels: int, per_level: int) -> list[int]:
    """SGM input-block index of each level's first resnet (block 0 is conv_in)."""
    return [1 + level * (per_level + 1) for level in range(n_levels)]


def _depth(sd: dict[str, torch.Tensor], block: str) -> int:
    """Transformer depth of the SGM attention block `block` (0 when it has no attention)."""
    return count_blocks(sd, f"{block}.1.transformer_blocks.")


def unet_config(sd: dict[str, torch.Tensor], pooled_dim: int | None) -> dict[str, Any]:
    """UNet2DConditionModel config from an SGM UNet state dict (prefix removed).

    `pooled_dim` is CLIP-G's projection width when known: the added-conditioning input is that
    plus 6 time ids, which gives the time-id width; otherwise SDXL-base's 256 is assumed.
    """
    width = sd["input_blocks.0.0.weight"].shape[0]
    n_levels = 1 + sum(1 for k in sd if k.startswith("input_blocks.") and k.endswith(".0.op.weight"))
    per_level = (count_blocks(sd, "input_blocks.") - 1 - (n_levels - 1)) // n_levels
    starts = _level_starts(n_levels, per_level)
    channels = [sd[f"input_blocks.{s}.0.out_layers.3.weight"].shape[0] for s in starts]
    depths = [_depth(sd, f"input_blocks.{s}") for s in starts]
    attn = next(f"input_blocks.{s}.1." for s, d in zip(starts, depths) if d)
    config: dict[str, Any] = {
        "sample_size": 128, "in_channels": sd["input_blocks.0.0.weight"].shape[1],
        "out_channels": sd["out.2.weight"].shape[0],
        "down_block_types": ["CrossAttnDownBlock2D" if d else "DownBlock2D" for d in depths],
        "up_block_types": ["CrossAttnUpBlock2D" if d else "UpBlock2D" for d in reversed(depths)],
        "mid_block_type": "UNetMidBlock2DCrossAttn" if _depth(sd, "middle_block") else None,
        "block_out_channels": channels, "layers_per_block": per_level,
        "transformer_layers_per_block": [max(d, 1) for d in depths],
        "attention_head_dim": [max(1, c // head_width(c)) for c in channels],
        "norm_num_groups": norm_groups(width),
        "cross_attention_dim": sd[attn + "transformer_blocks.0.attn2.to_k.weight"].shape[1],
        "use_linear_projection": sd[attn + "proj_in.weight"].ndim == 2,
        "flip_sin_to_cos": True, "freq_shift": 0,
    }
    if sd["time_embed.0.weight"].shape[0] != 4 * width:
        config["time_embedding_dim"] = sd["time_embed.0.weight"].shape[0]
    config.update(_reverse_depths(sd, depths, per_level))
    config.update(_added_conditioning(sd, pooled_dim))
    return config


def _reverse_depths(sd: dict[str, torch.Tensor], depths: list[int], per_level: int) -> dict:
    """`reverse_transformer_layers_per_block` when the up path's depths differ from the down path's."""
    up = [_depth(sd, f"output_blocks.{level * (per_level + 1)}") for level in range(len(depths))]
    if up == list(reversed(depths)):
        return {}
    return {"reverse_transformer_layers_per_block": [[max(d, 1)] * (per_level + 1) for d in up]}


def _added_conditioning(sd: dict[str, torch.Tensor], pooled_dim: int | None) -> dict[str, Any]:
    """SDXL's "text_time" added conditioning from `label_emb.0.0`, if the UNet has it."""
    if "label_emb.0.0.weight" not in sd:
        return {}
    total = sd["label_emb.0.0.weight"].shape[1]
    time_width = (total - pooled_dim) // 6 if pooled_dim else SDXL_TIME_ID_WIDTH
    return {"addition_embed_type": "text_time", "addition_time_embed_dim": time_width,
            "projection_class_embeddings_input_dim": total}


def check_sdxl_layout(sd: dict[str, torch.Tensor], path: Path) -> None:
    """Refuse, before any work, a file without an SGM-layout UNet (SD3, diffusers layout, ...)."""
    if not any(k.startswith(UNET_PREFIX + "input_blocks.") for k in sd):
        raise ModelFileError(f"{path} does not look like an SDXL checkpoint: no "
                             f"{UNET_PREFIX}input_blocks.* tensors (expected the original SGM "
                             "layout of sd_xl_base_1.0.safetensors)")


def load_sdxl_unet(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   pooled_dim: int | None) -> Any:
    """The SDXL UNet of a whole-checkpoint state dict, via diffusers' SGM converter."""
    from diffusers import UNet2DConditionModel
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    check_sdxl_layout(sd, path)
    try:
        config = unet_config(_prefixed(sd, UNET_PREFIX), pooled_dim)
        unet_sd = convert_ldm_unet_checkpoint({k: v for k, v in sd.items()
                                               if k.startswith(UNET_PREFIX)}, config)
    except (KeyError, StopIteration, IndexError) as err:
        raise _missing(path, "an SDXL UNet", err) from None
    with torch.device("meta"):
        model = UNet2DConditionModel(**config)
    return assign_state(model, cast_state(unet_sd, dtype), path, "SDXL UNet")


# ---------------------------------------------------------------------------------------------
# Autoencoder and CLIP encoders from inside a checkpoint


def vae_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
                   scale: dict[str, Any]) -> Any:
    """An AutoencoderKL from LDM-layout tensors (prefix removed); `scale`: the family's factors."""
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    try:
        config = _vae_config(sd, ldm=True)
        width = sd["encoder.conv_in.weight"].shape[0]
        config.update(scale, norm_num_groups=norm_groups(width), force_upcast=width >= 128)
        vae_sd = convert_ldm_vae_checkpoint(sd, config)
    except KeyError as err:
        raise _missing(path, "an autoencoder", err) from None
    with torch.device("meta"):
        model = AutoencoderKL(**config)
    return assign_state(model, cast_state(vae_sd, dtype), path, "autoencoder")


def load_vae(file: Path | None, sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype,
             scale: dict[str, Any]) -> tuple[Any, list[Path]] | None:
    """`model.vae` if given, else the checkpoint's bundled one; None when neither exists."""
    if file is not None:
        own = strip_prefix(read_safetensors(Path(file), "autoencoder"), (VAE_PREFIX, "vae."))
        if not any(k.startswith("encoder.down.") for k in own):
            raise ModelFileError(f"{file} does not look like an LDM-layout autoencoder: no "
                                 "encoder.down.* tensors")
        return vae_from_state(own, Path(file), dtype, scale), [Path(file)]
    bundled = _prefixed(sd, VAE_PREFIX)
    return (vae_from_state(bundled, path, dtype, scale), []) if bundled else None


def clip_from_state(sd: dict[str, torch.Tensor], path: Path, dtype: torch.dtype, tokenizer: Any,
                    projection: bool, act: str) -> Any:
    """A CLIP text encoder from transformers-layout tensors; sizes from shapes.

    `projection` builds CLIPTextModelWithProjection (identity projection when the file has none,
    as SD3 uses CLIP-L's pooled output unprojected); `act` is not recorded in the weights:
    "quick_gelu" for CLIP-L, "gelu" for OpenCLIP-G.
    """
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    tower = {k.removeprefix("text_model."): v for k, v in sd.items() if k != "text_projection.weight"
             and k.removeprefix("text_model.").split(".", 1)[0] in ("embeddings", "encoder",
                                                                     "final_layer_norm")}
    try:
        vocab, hidden = tower["embeddings.token_embedding.weight"].shape
        proj = sd.get("text_projection.weight", torch.eye(hidden, dtype=torch.float32))
        config = CLIPTextConfig(
            vocab_size=vocab, hidden_size=hidden,
            intermediate_size=tower["encoder.layers.0.mlp.fc1.weight"].shape[0],
            num_hidden_layers=count_blocks(tower, "encoder.layers."),
            num_attention_heads=hidden // head_width(hidden),
            max_position_embeddings=tower["embeddings.position_embedding.weight"].shape[0],
            projection_dim=proj.shape[0], hidden_act=act,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
    except KeyError as err:
        raise _missing(path, "a CLIP text encoder", err) from None
    if projection:
        state = {f"text_model.{k}": v for k, v in tower.items()}
        state["text_projection.weight"] = proj
        cls: Any = CLIPTextModelWithProjection
    else:
        state, cls = tower, CLIPTextModel
    with torch.device("meta"):
        expected = cls(config).state_dict().keys()
    missing = [k for k in expected if k not in state]
    if missing:
        raise ModelFileError(f"{path} is not a complete CLIP text encoder: {len(missing)} tensors "
                             f"missing, e.g. {missing[:3]}")
    state = {k: v for k, v in state.items() if k in expected}
    # from_pretrained with an in-memory state dict builds the non-persistent buffers properly.
    return cls.from_pretrained(None, config=config, state_dict=cast_state(state, dtype),
                               torch_dtype=dtype).eval()


def open_clip_state(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """OpenCLIP-layout tensors under `prefix` renamed to transformers' CLIP names (diffusers' map)."""
    from diffusers.loaders.single_file_utils import convert_open_clip_checkpoint

    return convert_open_clip_checkpoint(None, sd, prefix=prefix)


# ---------------------------------------------------------------------------------------------
# Tokenizers and folder fallbacks


def tokenizers(folder: Path | None, subs: tuple[str, ...], cls: Any, what: str) -> list[Any]:
    """The tokenizers in `folder`'s `subs`: single checkpoints do not carry them."""
    if folder is None or not all((folder / s).is_dir() for s in subs):
        where = f"{folder} lacks some of them" if folder is not None else "model.path is not set"
        raise ModelFileError(
            f"a single-file {what} checkpoint needs its tokenizers ({', '.join(subs)}), which "
            f"are not stored in checkpoints and are never downloaded, and {where}; set model.path "
            f"to a folder holding {'/, '.join(subs)}/ (a diffusers-format {what} folder, or a "
            "copy of just those subfolders)")
    return [from_folder(cls, folder, s, None, what) for s in subs]


def from_folder_or_fail(folder: Path | None, sub: str, cls: Any, dtype: torch.dtype, what: str,
                        path: Path, hint: str) -> tuple[Any, list[Path]]:
    """A component missing from the checkpoint, from the folder's `sub`, else a clear error."""
    if folder is not None and (folder / sub).is_dir():
        return from_folder(cls, folder, sub, dtype, what), folder_files(folder, [sub])[1:]
    raise ModelFileError(f"{path} does not bundle the {sub.replace('_', ' ')} ({hint}); "
                         f"{'set model.path to a diffusers-format ' + what + ' folder with ' + sub + '/'}")


def _folder(cfg: ModelConfig) -> Path | None:
    """model.path, expanded, if given."""
    return Path(cfg.path).expanduser() if cfg.path is not None else None


# ---------------------------------------------------------------------------------------------
# SDXL


def load_sdxl_file(cfg: ModelConfig, dtypes: dict[str, torch.dtype],
                   text_only: bool = False) -> dict[str, Any]:
    """Every SDXL component from `cfg.transformer` (see the module docstring for fallbacks).

    `dtypes` has "unet", "vae", "text_encoders"; returns StableDiffusionXLPipeline's component
    names plus "name" and "fingerprint". `text_only`: the two CLIPs alone (for a reload).
    """
    from diffusers import AutoencoderKL, EulerDiscreteScheduler
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    from difftune.families.tiny_sd import SDXL_SCHEDULER_CONFIG

    path, folder = Path(cfg.transformer).expanduser(), _folder(cfg)
    tok_l, tok_g = tokenizers(folder, ("tokenizer", "tokenizer_2"), CLIPTokenizer, "SDXL")
    sd = read_safetensors(path, "SDXL checkpoint (original SGM layout)")
    check_sdxl_layout(sd, path)
    te = dtypes["text_encoders"]
    files = [path]
    if any(k.startswith(SDXL_CLIP_G_PREFIX) for k in sd):
        clip_g = clip_from_state(open_clip_state(sd, SDXL_CLIP_G_PREFIX), path, te, tok_g,
                                 projection=True, act="gelu")
    else:
        clip_g, more = from_folder_or_fail(folder, "text_encoder_2", CLIPTextModelWithProjection,
                                           te, "SDXL", path, SDXL_CLIP_G_PREFIX + "*")
        files += more
    if any(k.startswith(SDXL_CLIP_L_PREFIX) for k in sd):
        clip_l = clip_from_state(_prefixed(sd, SDXL_CLIP_L_PREFIX), path, te, tok_l,
                                 projection=False, act="quick_gelu")
    else:
        clip_l, more = from_folder_or_fail(folder, "text_encoder", CLIPTextModel, te, "SDXL",
                                           path, SDXL_CLIP_L_PREFIX + "*")
        files += more
    if text_only:
        return {"text_encoder": clip_l, "text_encoder_2": clip_g}
    unet = load_sdxl_unet(sd, path, dtypes["unet"], clip_g.config.projection_dim)
    vae, more = load_vae(cfg.vae, sd, path, dtypes["vae"], SDXL_VAE_SCALE) or \
        from_folder_or_fail(folder, "vae", AutoencoderKL, dtypes["vae"], "SDXL", path,
                            VAE_PREFIX + "*; or set model.vae")
    return {"unet": unet, "vae": vae, "text_encoder": clip_l, "text_encoder_2": clip_g,
            "tokenizer": tok_l, "tokenizer_2": tok_g,
            "scheduler": EulerDiscreteScheduler(**SDXL_SCHEDULER_CONFIG),
            "name": path.stem, "fingerprint": fingerprint(files + more)}


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

    mmdit = _prefixed(sd, UNET_PREFIX)
    check_sd3_layout(sd, path)
    try:
        config = sd3_config(mmdit)
        converted = convert_sd3_transformer_checkpoint_to_diffusers(dict(mmdit))
    except (KeyError, IndexError, ValueError) as err:
        raise _missing(path, "an SD3/3.5 transformer", err) from None
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    return assign_state(model, cast_state(converted, dtype), path, "SD3 transformer")


def _sd3_encoder(sd: dict, name: str, build: Callable[[dict], Any], file: Path | None,
                 load_file: Callable[[Path], Any] | None) -> tuple[Any, list[Path]] | None:
    """One SD3 text encoder: bundled in the checkpoint, else its own single file, else None."""
    bundled = _prefixed(sd, SD3_ENCODER_PREFIXES[name])
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

    path, folder = Path(cfg.transformer).expanduser(), _folder(cfg)
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
