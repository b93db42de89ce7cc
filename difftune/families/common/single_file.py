"""Reading model weights from single safetensors files, safely.

Used by every family's single-file loader: safetensors reading with clear errors (pickle
refused), prefix stripping and casting, meta-device assignment and the weights' fingerprint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from difftune.errors import ModelFileError
from difftune.files.safe import is_pickle, pickle_refusal

_T5_PREFIXES = ("text_encoders.t5xxl.transformer.", "t5xxl.transformer.", "t5xxl.", "te2.")

# ---------------------------------------------------------------------------------------------
# Safe file access


def pickle_error(path: Path) -> ModelFileError:
    """The refusal for pickle-based weights, with the conversion recipe."""
    return ModelFileError(pickle_refusal(path))


def count_blocks(state: dict[str, torch.Tensor], prefix: str) -> int:
    """Number of `prefix.<i>.` blocks in a state dict."""
    ids = {int(k[len(prefix):].split(".", 1)[0]) for k in state if k.startswith(prefix)}
    return max(ids) + 1 if ids else 0


def _check_weights_file(path: Path, what: str) -> Path:
    """A path that exists, is a file and is safetensors by name; else a ModelFileError."""
    path = Path(path).expanduser()
    if is_pickle(path):
        raise pickle_error(path)
    if not path.exists():
        raise ModelFileError(f"{path} does not exist; expected the {what} as a .safetensors file")
    if not path.is_file():
        raise ModelFileError(f"{path} is not a file; expected the {what} as a .safetensors file")
    if path.suffix.lower() != ".safetensors":
        raise ModelFileError(
            f"{path} is not a .safetensors file; expected the {what} in safetensors format")
    return path


def read_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file (memory-mapped); a clear error for corrupt files."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = _check_weights_file(path, what)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelFileError(
            f"{path} could not be read as safetensors ({err}); expected the {what} — the file "
            "may be truncated or not a safetensors file (re-download or re-convert it)"
        ) from None


def strip_prefix(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict:
    """Drop the first of `prefixes` that every matching key carries (checkpoint wrappers)."""
    for prefix in prefixes:
        if any(k.startswith(prefix) for k in state):
            return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    return state


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast floating tensors (fp8 included) to `dtype`, applying ComfyUI fp8 scales if present.

    "scaled fp8" files store `<w>.scale_weight` beside each fp8 weight: the real weight is
    their product, computed in fp32 before the final cast.
    """
    out = {}
    for key, value in state.items():
        if key.endswith((".scale_weight", ".scale_input")) or key == "scaled_fp8":
            continue
        scale = state.get(key[: -len(".weight")] + ".scale_weight") if key.endswith(
            ".weight") else None
        if value.is_floating_point():
            value = value.to(torch.float32) * scale.to(torch.float32) if scale is not None else value
            value = value.to(dtype)
        out[key] = value
    return out


def fingerprint(paths: list[Path]) -> str:
    """Identity of the weights: sha256 over each file's path, size and mtime (no content read)."""
    h = hashlib.sha256()
    for p in sorted({Path(p).resolve() for p in paths}):
        st = p.stat()
        h.update(f"{p}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]



def assign_state(model: torch.nn.Module, sd: dict[str, torch.Tensor], path: Path, what: str) -> Any:
    """Load a full state dict into a meta-initialised model (no fp32 copy of the weights)."""
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except RuntimeError as err:
        raise ModelFileError(f"{path} does not match the {what} its shapes describe: "
                             f"{str(err)[:500]}") from None
    return model.eval()


def prefixed(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix`, with it removed."""
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def missing_error(path: Path, what: str, err: Exception) -> ModelFileError:
    """The error for a checkpoint lacking a tensor its layout needs."""
    return ModelFileError(f"{path} does not look like {what}: tensor {err} is missing or "
                          "misshapen; expected an original-layout (SGM/Stability) checkpoint")
