"""Which files difftune will read: safetensors yes, pickle never.

A pickle-based file (.ckpt/.pt/.pth/.bin/.pkl) can run arbitrary code when it is loaded, so
every reader refuses it with the same explanation and the one-time conversion recipe.
"""

from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle")


def is_pickle(path: Path) -> bool:
    """True for the file name suffixes of pickle-based weight formats."""
    return Path(path).suffix.lower() in PICKLE_SUFFIXES


def pickle_refusal(path: Path) -> str:
    """The message refusing a pickle-based file, with how to convert it."""
    return (
        f"{path} is a pickle-based file; loading it could run arbitrary code, so difftune reads "
        "only .safetensors. Convert it once in an environment you trust: load it with "
        "torch.load(path, weights_only=True) (or the library that made it) and write it with "
        "safetensors.torch.save_file(state_dict, 'model.safetensors'), then point the config at "
        "the new file"
    )
