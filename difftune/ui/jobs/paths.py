"""Every path a job will read or write, checked against the roots before it is queued and
again before it starts.

A job names paths in three places: its options (`--out`, `--lora`, `--prompts`, `--resume`,
`--init-lora`), its `--set` overrides, and its run file. The run file's paths are checked in
its raw TOML (with the overrides applied) before it is loaded: loading reads model files'
headers and asks whether the files it names exist, so it must touch nothing outside the roots
and no refusal may describe such a file. They are found from the config models' field types
(`config.raw_paths`), so a path field added to the config later is covered without a list kept
here. The loaded config (`load_config`, as the CLI reads it) is walked next for the paths
loading adds. A run file the CLI would refuse is left to the job: the CLI stops at the same
error before touching any path.

What a job writes (`--out`, save.dir, cache.dir) must lie under the roots; what it only reads
may also be the data shipped with difftune (the tiny preset's demo dataset and prompt file).
"""

from __future__ import annotations

import logging
import tomllib
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from pydantic import BaseModel

from difftune.config.errors import parse_override
from difftune.errors import ConfigError
from difftune.ui.limits import TooLarge, read_text
from difftune.ui.security import PathOutsideRoots, Roots

# Options of the CLI verbs that name a file or folder: each goes through the roots.
PATH_OPTIONS = ("--resume", "--init-lora", "--lora", "--prompts", "--out")
# Options whose abbreviations argparse would also take (`--ou` for `--out`): refused, so no
# path reaches the CLI unchecked.
CHECKED_OPTIONS = (*PATH_OPTIONS, "--set")
# The options and config fields a job writes to; every other path it names it only reads.
WRITTEN_OPTIONS = ("--out",)
WRITTEN_FIELDS = ("save.dir", "cache.dir")


def reading(roots: Roots) -> Roots:
    """The folders a job, or a report, may read from: the roots and the data shipped with
    difftune (`difftune/assets`: the demo images, captions and prompt file), never written."""
    shipped = Path(str(resources.files("difftune") / "assets")).resolve()
    return Roots((*roots.folders, shipped))


def option_values(args: list[str], option: str) -> list[str]:
    """The values given to `option` in `args` (`--opt VALUE` or `--opt=VALUE`)."""
    out = []
    for i, arg in enumerate(args):
        if arg == option and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith(option + "="):
            out.append(arg[len(option) + 1:])
    return out


def checked_args(args: list[str], roots: Roots) -> list[str]:
    """`args` with every path an option names resolved through the roots (PathOutsideRoots
    naming the option for one outside them or in the app's folder): absolute, so the job's
    working folder does not change them. ValueError for an abbreviated path option."""
    out = list(args)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if name.startswith("--") and len(name) > 2 and name not in CHECKED_OPTIONS and \
                any(full.startswith(name) for full in CHECKED_OPTIONS):
            raise ValueError(f"{name} is an abbreviated option; write it in full ("
                             f"{' or '.join(o for o in CHECKED_OPTIONS if o.startswith(name))})")
        if name not in PATH_OPTIONS:
            continue
        if not eq:
            if i + 1 >= len(out) or out[i + 1].startswith("--"):
                continue
            value = out[i + 1]
        resolved = _checked_path(name, value, roots)
        if eq:
            out[i] = f"{name}={resolved}"
        else:
            out[i + 1] = resolved
    return out


def _checked_path(option: str, value: str, roots: Roots) -> str:
    """One option's path resolved through the roots (`--resume latest` and a `--lora`
    file's `:WEIGHT` kept as they are)."""
    if option == "--resume" and value == "latest":
        return value
    path, weight = value, ""
    if option == "--lora" and ":" in value:
        head, _, tail = value.rpartition(":")
        try:
            float(tail)
            path, weight = head, ":" + tail
        except ValueError:
            pass
    within = roots if option in WRITTEN_OPTIONS else reading(roots)
    try:
        return f"{within.resolve(path, write=True)}{weight}"
    except PathOutsideRoots as err:
        raise PathOutsideRoots(f"{option} {value}: {err}") from None


def config_paths(node: Any, prefix: str = "") -> Iterator[tuple[str, Path]]:
    """(dotted field, path) of every path a validated config holds: each field whose value
    is a Path or a list of them, in every section, dataset and subset (the dotted name as
    `--set` writes it: datasets.0.subsets.0.path)."""
    if isinstance(node, Path):
        yield prefix, node
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            yield from config_paths(item, f"{prefix}.{i}")
    elif isinstance(node, BaseModel):
        for name in type(node).model_fields:
            yield from config_paths(getattr(node, name), f"{prefix}.{name}" if prefix else name)


def raw_run_file(config: Path, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The run file's raw TOML with the job's `--set` overrides applied (one that cannot be
    applied is skipped: the CLI refuses it), None when it is not TOML the CLI reads (the CLI
    stops there, before any path). TooLarge for a file larger than a run file can be."""
    try:
        data = tomllib.loads(read_text(config))
    except TooLarge:
        raise
    except (OSError, ConfigError, tomllib.TOMLDecodeError):
        return None
    for override in overrides:
        try:
            parse_override(data, override)
        except ConfigError:
            pass
    return data


def check_named_paths(data: dict[str, Any], base: Path, roots: Roots,
                      origin: Callable[[str, str], str]) -> None:
    """Check every path the raw run-file mapping `data` names (its path fields, found from the
    config models' types; relative ones taken from `base`, links followed) before anything
    opens one: PathOutsideRoots starting with `origin(field, value)` for one outside the roots
    (a path only read: and the shipped data) or in the app's own folder."""
    from difftune.config.raw_paths import raw_paths
    from difftune.config.run import RunConfig

    readable = reading(roots)
    for field, value in raw_paths(data, RunConfig):
        within = roots if field in WRITTEN_FIELDS else readable
        try:
            within.resolve(base / Path(value).expanduser(), write=True)  # as load_config
        except PathOutsideRoots as err:
            raise PathOutsideRoots(f"{origin(field, value)}: {err}") from None


def check_named_in(config: Path, roots: Roots, overrides: Sequence[str] = ()) -> None:
    """Check every path the run file `config` names, with `overrides` (`--set`) applied, in
    its raw TOML (`check_named_paths`): before anything loads it, which would read model
    files' headers and ask whether the files it names exist. Nothing for a file that is not
    TOML: loading it stops there."""
    data = raw_run_file(config, overrides)
    if data is not None:
        origin = partial(_origin, config=config, overrides=overrides)
        check_named_paths(data, config.resolve().parent, roots, origin)  # as load_config


def check_run_file(config: Path, args: list[str], roots: Roots) -> None:
    """Check every path of the run file `config` with the job's `--set` overrides:
    PathOutsideRoots naming the field (and the `--set` that gave it) for one outside the roots
    (a path only read: and the shipped data) or in the app's own folder. The paths the file
    names are checked in its raw TOML first (`check_named_in`), so loading it touches nothing
    outside the roots; then the loaded config's, for what loading adds (cache.dir's default
    under save.dir)."""
    overrides = option_values(args, "--set")
    check_named_in(config, roots, overrides)
    from difftune.config import load_config

    quiet = logging.getLogger("difftune")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # the job's own log gets the config's warnings
    try:
        cfg = load_config(config, overrides)
    except Exception:  # noqa: BLE001 - a ConfigError, or whatever else stops the load
        return  # stops the CLI at the same place, before it reads or writes anything
    finally:
        quiet.setLevel(level)
    readable = reading(roots)
    for field, path in config_paths(cfg):
        try:
            (roots if field in WRITTEN_FIELDS else readable).resolve(path, write=True)
        except PathOutsideRoots as err:
            raise PathOutsideRoots(f"{_origin(field, str(path), config, overrides)}: "
                                   f"{err}") from None


def _origin(field: str, value: str, config: Path, overrides: Sequence[str]) -> str:
    """Where a config path came from, for the refusal: the last `--set` of the field (or of
    a section holding it), or the run file's field."""
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        if field == key or field.startswith(key + "."):
            return f"--set {item} ({field})"
    return f"{field} = {value} in the run file {config}"


def load_checked(path: Path, roots: Roots | None = None) -> Any:
    """The run file `path` loaded as the CLI loads it (its ConfigError raised), once every
    path it names is found under `roots` (PathOutsideRoots otherwise; the shipped data may be
    read too): loading reads model files' headers and asks whether the files exist."""
    from difftune.config import load_config

    if roots is not None:
        check_named_in(path, reading(roots))
    return load_config(path)
