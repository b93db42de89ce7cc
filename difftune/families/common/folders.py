"""Loading the components of a diffusers-format model folder, local files and safetensors only.

Shared by the family loaders: `model.path` must hold model_index.json and one subfolder per
component; each is read with its class's `from_pretrained(local_files_only=True,
use_safetensors=True)`. Every missing or unsafe part is a `ModelFileError` naming the path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.families.component_files import pickle_error
from difftune.safefiles import is_pickle


def check_folder(folder: Path, what: str) -> None:
    """The folder exists and looks like a diffusers folder (`what`: "FLUX.1", "SDXL", ...)."""
    if not folder.is_dir():
        raise ModelFileError(
            f"{folder} is not a folder; model.path must be a diffusers-format {what} folder "
            "(model_index.json and one subfolder per component)")
    if not (folder / "model_index.json").is_file():
        raise ModelFileError(
            f"{folder} has no model_index.json; model.path must be a diffusers-format {what} "
            "folder")


def check_subfolder(folder: Path, sub: str, weights: bool) -> Path:
    """The component subfolder exists (with a config) and holds safetensors weights."""
    path = folder / sub
    if not path.is_dir():
        raise ModelFileError(f"{path} is missing; expected the {sub} component of {folder}")
    if weights:
        if not (path / "config.json").is_file():
            raise ModelFileError(f"{path}/config.json is missing; expected the {sub} config")
        files = [p for p in path.iterdir() if p.is_file()]
        if not any(p.name.endswith(".safetensors") for p in files):
            pickles = [p for p in files if is_pickle(p)]
            if pickles:
                raise pickle_error(pickles[0])
            raise ModelFileError(f"{path} holds no .safetensors weights; expected the {sub} "
                                 "weights (diffusion_pytorch_model.safetensors or model.safetensors)")
    return path


def from_folder(cls: Any, folder: Path, sub: str, dtype: torch.dtype | None, what: str) -> Any:
    """One component via its class's from_pretrained (weights when `dtype` is given)."""
    check_subfolder(folder, sub, weights=dtype is not None)
    kwargs: dict[str, Any] = {"subfolder": sub, "local_files_only": True}
    if dtype is not None:
        kwargs.update(torch_dtype=dtype, use_safetensors=True)
    try:
        return cls.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError, RuntimeError, json.JSONDecodeError) as err:
        raise ModelFileError(
            f"{folder / sub} could not be loaded as the {what} {sub} ({type(err).__name__}: "
            f"{err}); check that the folder is complete and in the diffusers layout") from None


def folder_files(folder: Path, subs: list[str]) -> list[Path]:
    """Every file of the named component subfolders (for the fingerprint)."""
    files = [folder / "model_index.json"]
    for sub in subs:
        files += [p for p in sorted((folder / sub).rglob("*")) if p.is_file()]
    return files
