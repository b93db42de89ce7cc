"""The files a full fine-tune is written as: each trained model as a diffusers folder.

`<save.dir>/<name>/<subfolder>/` holds one trained model (the denoiser in `transformer/` or
`unet/`, a trained text encoder in `text_encoder/`...: the subfolders of the family's
diffusers pipeline), its `config.json` and its weights in `save.dtype`, in the file names
`from_pretrained` reads (`diffusion_pytorch_model.safetensors` for diffusers models,
`model.safetensors` for transformers ones), sharded with an index when large. The weights are
cast and copied to the host one shard at a time (files/shards.py), never the model at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from difftune.files.shards import SHARD_BYTES, write_sharded


def weights_name(module: torch.nn.Module) -> str:
    """The weights file name `from_pretrained` reads for this kind of model."""
    from diffusers import ModelMixin

    return ("diffusion_pytorch_model.safetensors" if isinstance(module, ModelMixin)
            else "model.safetensors")


def unique_state(module: torch.nn.Module, state: Mapping[str, torch.Tensor] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The module's state dict (or `state`, e.g. gathered from FSDP shards) without the second
    name of a tied tensor (safetensors refuses shared storage; `from_pretrained` re-ties the
    weights)."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    out = {}
    for name, t in (module.state_dict() if state is None else state).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out[name] = t
    return out


def save_folder(module: torch.nn.Module, folder: Path, dtype: torch.dtype,
                max_bytes: int = SHARD_BYTES, state: Mapping[str, torch.Tensor] | None = None
                ) -> Path:
    """`module` as a diffusers/transformers model folder (config and weights in `dtype`);
    `state`: its weights when not its own `state_dict()` (gathered from FSDP shards)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(module, "config", None)
    if hasattr(module, "save_config"):  # diffusers ModelMixin
        module.save_config(folder)
        _own_class_name(module, folder / "config.json")
    elif config is not None and hasattr(config, "save_pretrained"):  # transformers
        config.torch_dtype = dtype
        config.save_pretrained(folder)
    write_sharded(folder / weights_name(module), unique_state(module, state), dtype, max_bytes,
                  metadata={"format": "pt"})
    return folder


def _own_class_name(module: torch.nn.Module, config: Path) -> None:
    """FSDP2 turns a sharded model's class into a subclass named `FSDP<name>`, which diffusers
    writes as `_class_name`: the file names the model's own class instead."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    own = next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))
    doc = json.loads(config.read_text(encoding="utf-8"))
    doc["_class_name"] = own.__name__
    config.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8")
