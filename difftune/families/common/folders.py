"""Loading the components of a diffusers-format model folder, local files and safetensors only.

Shared by the family loaders: `model.path` must hold model_index.json and one subfolder per
component; each is read with its class's `from_pretrained(local_files_only=True,
use_safetensors=True)`. Every missing or unsafe part is a `ModelFileError` naming the path.
Single-file loaders take what a checkpoint lacks (tokenizers, unbundled parts) from here too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from difftune.errors import ModelFileError
from difftune.families.common.single_file import pickle_error
from difftune.files.safe import is_pickle

if TYPE_CHECKING:
    from difftune.config import ModelConfig


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


def model_folder(cfg: "ModelConfig") -> Path | None:
    """model.path, expanded, if given."""
    return Path(cfg.path).expanduser() if cfg.path is not None else None


def _class(qualified: str) -> Any:
    """The class named "module.Class" (imported lazily: diffusers/transformers are slow to load)."""
    import importlib

    module, name = qualified.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def load_folder(folder: Path, parts: tuple[tuple[str, str, bool], ...],
                dtypes: dict[str, torch.dtype], what: str) -> dict[str, Any]:
    """Every component of a diffusers `what` folder ("SDXL", ...) by its subfolder name.

    `parts` are (subfolder, "module.Class", holds weights) in the released layout; `dtypes`
    maps the denoiser's subfolder, "vae" and "text_encoders" to the dtype each is read in.
    Adds "fingerprint" (path/size/mtime of every component file, so caches follow the files)
    and "name" (the folder's).
    """
    from difftune.families.common.single_file import fingerprint

    check_folder(folder, what)
    out: dict[str, Any] = {}
    for sub, cls, weights in parts:
        dtype = dtypes.get(sub, dtypes["text_encoders"]) if weights else None
        out[sub] = from_folder(_class(cls), folder, sub, dtype, what)
    out["fingerprint"] = fingerprint(folder_files(folder, [p[0] for p in parts]))
    out["name"] = folder.name
    return out


def load_folder_text_encoders(folder: Path, parts: tuple[tuple[str, str, bool], ...],
                              dtype: torch.dtype, what: str) -> dict[str, Any]:
    """Only the text encoders (`text_encoder*` subfolders) of a diffusers folder (a reload
    after unloading)."""
    return {sub: from_folder(_class(cls), folder, sub, dtype, what)
            for sub, cls, _ in parts if sub.startswith("text_encoder")}
