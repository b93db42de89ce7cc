"""Reading a run file: TOML, `--set` overrides, validation, paths resolved against the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from difftune.config.checks import check_paths, warn_ignored
from difftune.config.errors import format_validation_error, parse_override
from difftune.config.model_source import family_problem
from difftune.config.raw_paths import resolved_against
from difftune.config.run import RunConfig
from difftune.config.sections import ModelConfig
from difftune.errors import ConfigError, ModelFileError


def _resolve_paths(node: Any, base: Path) -> None:
    """Make every Path field of `node` (recursively) absolute, relative to `base`: a lone
    Path and each Path of a list (a subset's control_path folders)."""
    if isinstance(node, list):
        for item in node:
            _resolve_paths(item, base)
        return
    if not isinstance(node, BaseModel):
        return
    for name in type(node).model_fields:
        value = getattr(node, name)
        if isinstance(value, Path):
            object.__setattr__(node, name, resolved_against(value, base))
        elif isinstance(value, list) and any(isinstance(v, Path) for v in value):
            object.__setattr__(node, name, [resolved_against(v, base) if isinstance(v, Path)
                                            else v for v in value])
        else:
            _resolve_paths(value, base)


def parse_config(data: dict[str, Any], base: Path, source: str = "config") -> RunConfig:
    """Validate a config mapping; relative paths are resolved against `base`.

    Also checks the model paths (cheap: existence and kind), so a wrong file is reported in
    seconds rather than after the data has been scanned.
    """
    wrong = family_problem(data.get("model"), base, ModelConfig.model_fields["family"].default)
    if wrong is not None:  # alone: the other family's file list would only mislead
        raise ModelFileError(f"{source}: model files:\n  - {wrong}")
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, RunConfig)) from None
    _resolve_paths(cfg, base)
    if cfg.cache.dir is None:
        cfg.cache.dir = cfg.save.dir / "cache"
    warn_ignored(cfg)
    check_paths(cfg, source)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run file, apply `a.b=value` overrides, and validate everything at once."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; pass the path of a .toml run file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a .toml run file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}; fix the syntax at that place") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read ({err.strerror}); check its "
                          "permissions") from None
    for item in overrides or []:
        parse_override(data, item)
    return parse_config(data, path.resolve().parent, str(path))
