"""Where a `difftune lora` verb writes, without ever replacing a file the user has."""

from __future__ import annotations

from pathlib import Path

from difftune.errors import ConfigError


def out_path(source: Path, out: Path | None, tag: str, overwrite: bool) -> Path:
    """The file to write: `out`, or `<source stem>-<tag>.safetensors` beside `source`. An
    existing file is refused unless `overwrite` (the input itself always is: a failed run
    would have nothing to go back to)."""
    path = out if out is not None else source.with_name(f"{source.stem}-{tag}.safetensors")
    if path.resolve() == source.resolve():
        raise ConfigError(f"{path} is the input file; pass --out with another path")
    if path.exists() and not overwrite:
        raise ConfigError(f"{path} exists; pass --out with another path, or --overwrite to "
                          "replace it")
    if not path.parent.is_dir():
        raise ConfigError(f"{path.parent} is not a folder; create it or pass another --out")
    return path


def model_file(path: Path, what: str) -> Path:
    """`path` as a readable safetensors model file (`what` names the argument), else a
    refusal naming it and the fix (a pickle is never opened: it can run code)."""
    from difftune.files.safe import is_pickle, pickle_refusal

    if is_pickle(path):
        raise ConfigError(f"{what} {path}: {pickle_refusal(path)}")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist or is not a file")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            f.keys()
    except Exception as err:  # safetensors raises its own error types for bad headers
        raise ConfigError(f"{what} {path} is not a readable safetensors file ({err}); pass "
                          "the model's .safetensors file") from None
    return path
