"""Load FLUX.1 (dev or schnell) from local files only: a diffusers folder and/or single files.

Sources, from `ModelConfig`: `path` is a diffusers folder in the FLUX.1 layout; `transformer`,
`vae`, `clip_l` and `t5` are single .safetensors files as ComfyUI users keep them (BFL or
diffusers transformer layout, BFL `ae.safetensors`, `clip_l.safetensors`, `t5xxl_*.safetensors`).
A single file overrides the folder's component. Single files carry no config, so configs are
derived from tensor shapes (standard CLIP-L / T5-XXL / FLUX.1 values where shapes are silent);
BFL key names are converted with diffusers' own converters.

Weights are read only through safetensors: pickle files could run arbitrary code and are
refused. Every missing, unsafe or wrong file raises `ModelFileError` naming the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.autoencoder import load_ae_file
from difftune.families.common.components import load_clip_file, load_t5_file
from difftune.families.common.folders import check_folder, folder_files, from_folder, model_folder
from difftune.families.common.bfl import (DYNAMIC_SHIFT_SCHEDULER, bfl_blocks_layout,
                                          transformer_config, transformer_from_file)
from difftune.families.common.single_file import count_blocks, fingerprint
from difftune.families.flux.spec import SPEC

if TYPE_CHECKING:
    from difftune.config import ModelConfig
    from difftune.files.single import Layout

SUBFOLDERS = ("transformer", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
              "scheduler")
# Where tokenizers are looked up when only single files are given: the local Hugging Face
# cache (never the network), as populated by any earlier download of these repositories.
CLIP_TOKENIZER_REPO, T5_TOKENIZER_REPO = SPEC.files.tokenizer_repos
# FLUX.1-dev's and schnell's sampling schedules (their scheduler_config.json).
DEV_SCHEDULER_CONFIG: dict[str, Any] = DYNAMIC_SHIFT_SCHEDULER
SCHNELL_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False,
    "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}
_BFL_PREFIXES = ("model.diffusion_model.",)
VAE_SCALE = {"scaling_factor": 0.3611, "shift_factor": 0.1159}  # FLUX.1's ae (not in the file)

# ---------------------------------------------------------------------------------------------
# Single-file transformer


def _transformer_config(sd: dict[str, torch.Tensor], path: Path) -> dict[str, Any]:
    """FluxTransformer2DModel config from a diffusers-layout state dict's shapes."""
    try:
        pooled = sd["time_text_embed.text_embedder.linear_1.weight"].shape[1]
        return {**transformer_config(sd), "pooled_projection_dim": pooled,
                "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in sd}
    except KeyError as err:
        raise ModelFileError(f"{path} does not look like a FLUX.1 transformer: tensor {err} is "
                             "missing") from None


def bfl_to_diffusers(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL-layout FLUX.1 transformer weights -> diffusers names, via diffusers' converter.

    The converter assumes the 12B model's width when splitting each single block's fused
    `linear1` (q, k, v, mlp); those tensors are split here by their real width and the converter
    gets zero-width stand-ins, so any size converts and the renaming stays diffusers' own.
    """
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

    sd = dict(sd)
    hidden = sd["img_in.weight"].shape[0]
    fused = {}
    for i in range(count_blocks(sd, "single_blocks.")):
        for kind in ("weight", "bias"):
            key = f"single_blocks.{i}.linear1.{kind}"
            fused[(i, kind)] = sd.pop(key)
            sd[key] = torch.empty(3 * 3072 + 4 * 3072, 0)  # splits like the 12B model's
    out = convert_flux_transformer_checkpoint_to_diffusers(sd)
    for (i, kind), tensor in fused.items():
        mlp = tensor.shape[0] - 3 * hidden
        q, k, v, m = torch.split(tensor, (hidden, hidden, hidden, mlp), dim=0)
        base = f"single_transformer_blocks.{i}."
        for name, part in (("attn.to_q", q), ("attn.to_k", k), ("attn.to_v", v), ("proj_mlp", m)):
            out[f"{base}{name}.{kind}"] = part
    return out


def load_transformer_file(path: Path, dtype: torch.dtype) -> Any:
    """A FLUX.1 transformer from one safetensors file, original (BFL) or diffusers layout."""
    from diffusers import FluxTransformer2DModel

    return transformer_from_file(
        path, dtype, "FLUX.1 transformer", _BFL_PREFIXES, bfl_to_diffusers,
        lambda sd, where: FluxTransformer2DModel(**_transformer_config(sd, where)))


def _tokenizers(folder: Path | None) -> tuple[Any, Any]:
    """CLIP and T5 tokenizers: the folder's, else the local HF cache, else a clear error."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    if folder is not None:
        return (from_folder(CLIPTokenizer, folder, "tokenizer", None, "FLUX.1"),
                from_folder(T5TokenizerFast, folder, "tokenizer_2", None, "FLUX.1"))
    clip_dir, t5_dir = _cached_repo(CLIP_TOKENIZER_REPO), _cached_repo(T5_TOKENIZER_REPO)
    if clip_dir is not None and t5_dir is not None:
        return (CLIPTokenizer.from_pretrained(str(clip_dir), local_files_only=True),
                T5TokenizerFast.from_pretrained(str(t5_dir), local_files_only=True))
    raise ModelFileError(
            "single-file text encoders need their tokenizers, which are not inside "
            "clip_l/t5 .safetensors files and are not in the local Hugging Face cache "
            f"({CLIP_TOKENIZER_REPO}, {T5_TOKENIZER_REPO}); set model.path to a FLUX.1 "
            "diffusers folder holding tokenizer/ and tokenizer_2/ (only those two and "
            "model_index.json are needed when every component is given as a file)")


def _cached_repo(repo_id: str) -> Path | None:
    """The local HF-cache snapshot of a repository holding tokenizer files, or None.

    Only the cache is consulted (local_files_only): nothing is downloaded. A tokenizer class's
    own from_pretrained is not used for the probe because it may quietly build an empty
    tokenizer when no files exist.
    """
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any hub error means "not in the cache"
        return None
    names = {"tokenizer.json", "vocab.json", "spiece.model"}
    return path if any((path / n).is_file() for n in names) else None


def _is_dev(transformer: Any) -> bool:
    """FLUX.1-dev is guidance-distilled (has a guidance embedder); schnell is not."""
    return bool(transformer.config.guidance_embeds)


def _scheduler(folder: Path | None, dev: bool) -> Any:
    """The folder's scheduler, or FLUX.1-dev's / schnell's settings written in code."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if folder is not None and (folder / "scheduler").is_dir():
        return from_folder(FlowMatchEulerDiscreteScheduler, folder, "scheduler", None, "FLUX.1")
    return FlowMatchEulerDiscreteScheduler(
        **(DEV_SCHEDULER_CONFIG if dev else SCHNELL_SCHEDULER_CONFIG))


def _component(folder: Path | None, file: Path | None, sub: str, cls: Any,
               load_file: Any, dtype: torch.dtype) -> tuple[Any, list[Path]]:
    """One weighted component from its single file if given, else from the folder."""
    if file is not None:
        return load_file(Path(file), dtype), [Path(file)]
    assert folder is not None, "config validation guarantees a folder or every file"
    return from_folder(cls, folder, sub, dtype, "FLUX.1"), folder_files(folder, [sub])


def load_flux_files(cfg: "ModelConfig", dtypes: dict[str, torch.dtype]) -> dict[str, Any]:
    """Load every FLUX.1 component from local files (see the module docstring for sources).

    `dtypes` has the keys "transformer", "text_encoders" and "vae". Returns FluxPipeline's
    component names plus "t5_max_length" (512 for dev, 256 for schnell), "name" and
    "fingerprint" (path/size/mtime of every weight file, so caches follow the files).
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    folder = model_folder(cfg)
    if folder is not None:
        check_folder(folder, "FLUX.1")
    clip_tok, t5_tok = _tokenizers(folder)
    transformer, f1 = _component(folder, cfg.transformer, "transformer", FluxTransformer2DModel,
                                 load_transformer_file, dtypes["transformer"])
    vae, f2 = _component(folder, cfg.vae, "vae", AutoencoderKL, load_vae_file, dtypes["vae"])
    clip, f3 = _component(folder, cfg.clip_l, "text_encoder", CLIPTextModel,
                          lambda p, d: load_clip_file(p, d, clip_tok), dtypes["text_encoders"])
    t5, f4 = _component(folder, cfg.t5, "text_encoder_2", T5EncoderModel, load_t5_file,
                        dtypes["text_encoders"])
    dev = _is_dev(transformer)
    return {
        "transformer": transformer, "vae": vae, "text_encoder": clip, "tokenizer": clip_tok,
        "text_encoder_2": t5, "tokenizer_2": t5_tok, "scheduler": _scheduler(folder, dev),
        "t5_max_length": 512 if dev else 256,
        "name": cfg.name or _base_name(folder, cfg.transformer, dev),
        "fingerprint": fingerprint(f1 + f2 + f3 + f4),
    }


def load_flux_text_encoders(cfg: "ModelConfig", dtype: torch.dtype) -> dict[str, Any]:
    """Only CLIP-L and T5 ("text_encoder", "text_encoder_2"), from the same sources as
    `load_flux_files`: to reload encoders that were unloaded after caching."""
    from transformers import CLIPTextModel, T5EncoderModel

    folder = model_folder(cfg)
    clip_tok, _ = _tokenizers(folder)
    clip, _ = _component(folder, cfg.clip_l, "text_encoder", CLIPTextModel,
                         lambda p, d: load_clip_file(p, d, clip_tok), dtype)
    t5, _ = _component(folder, cfg.t5, "text_encoder_2", T5EncoderModel, load_t5_file, dtype)
    return {"text_encoder": clip, "text_encoder_2": t5}


def _base_name(folder: Path | None, transformer_file: Path | None, dev: bool) -> str:
    """A readable base-model name: the transformer file's or folder's name, else the variant."""
    if transformer_file is not None:
        return Path(transformer_file).stem
    if folder is not None:
        return folder.resolve().name
    return "flux.1-dev" if dev else "flux.1-schnell"


def load_vae_file(path: Path, dtype: torch.dtype) -> Any:
    """The FLUX.1 autoencoder from `ae.safetensors` (BFL/LDM layout) or a diffusers-layout file."""
    return load_ae_file(path, dtype, VAE_SCALE, "FLUX.1 autoencoder")


# --- the BFL single file (flux1-dev.safetensors layout) written for a full fine-tune ---------

_BFL_TOP = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
            "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
            "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
            "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
            "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
            "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
            "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}

def single_file_layout(model: torch.nn.Module) -> "Layout":
    """The FLUX.1 transformer in BFL's layout (as flux1-dev.safetensors, which ComfyUI and
    Forge load): fused qkv (and single blocks' q, k, v, mlp in `linear1`), the final layer's
    modulation in BFL's (shift, scale) order, RMSNorm weights as `.scale`."""
    from difftune.files.single import Piece, check_complete

    names = list(model.state_dict())
    out = bfl_blocks_layout(names)
    for kind in ("weight", "bias"):
        out |= {f"{dst}.{kind}": Piece((f"{src}.{kind}",)) for src, dst in _BFL_TOP.items()
                if f"{src}.{kind}" in names}
        out[f"final_layer.adaLN_modulation.1.{kind}"] = Piece((f"norm_out.linear.{kind}",), True)
    return check_complete(out, names, "FLUX.1 BFL")
