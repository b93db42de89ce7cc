"""The files a full fine-tune is written as: each trained model as a diffusers folder.

`<save.dir>/<name>/<subfolder>/` holds one trained model (the denoiser in `transformer/` or
`unet/`, a trained text encoder in `text_encoder/`...: the subfolders of the family's
diffusers pipeline), its `config.json` and its weights in `save.dtype`, in the file names
`from_pretrained` reads (`diffusion_pytorch_model.safetensors` for diffusers models,
`model.safetensors` for transformers ones), sharded with an index when large. The weights are
cast and copied to the host one shard at a time (files/shards.py), never the model at once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.files.shards import SHARD_BYTES, write_sharded


def weights_name(module: torch.nn.Module) -> str:
    """The weights file name `from_pretrained` reads for this kind of model."""
    from diffusers import ModelMixin

    return ("diffusion_pytorch_model.safetensors" if isinstance(module, ModelMixin)
            else "model.safetensors")


def unique_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict without the second name of a tied tensor (safetensors refuses
    shared storage; `from_pretrained` re-ties the weights)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in module.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def save_folder(module: torch.nn.Module, folder: Path, dtype: torch.dtype,
                max_bytes: int = SHARD_BYTES) -> Path:
    """`module` as a diffusers/transformers model folder (config and weights in `dtype`)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(module, "config", None)
    if hasattr(module, "save_config"):  # diffusers ModelMixin
        module.save_config(folder)
    elif config is not None and hasattr(config, "save_pretrained"):  # transformers
        config.torch_dtype = dtype
        config.save_pretrained(folder)
    write_sharded(folder / weights_name(module), unique_state(module), dtype, max_bytes,
                  metadata={"format": "pt"})
    return folder
