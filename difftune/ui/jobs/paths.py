"""Every path a job will read or write, checked against the roots before it is queued and
again before it starts.

A job names paths in three places: its options (`--out`, `--lora`, `--prompts`, `--resume`,
`--init-lora`), its `--set` overrides, and its run file. The run file is read the way the CLI
reads it (`load_config` with the overrides), and every path field of the validated config is
checked, found by walking the pydantic models' values (as `load_config` resolves them), so a
field added to the config later is covered without a list kept here. A run file the CLI
would refuse is left to the job: the CLI stops at the same error before touching any path.

What a job writes (`--out`, save.dir, cache.dir) must lie under the roots; what it only reads
may also be the data shipped with difftune (the tiny preset's demo dataset and prompt file).
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

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


def check_run_file(config: Path, args: list[str], roots: Roots) -> None:
    """Check every path of the run file `config` with the job's `--set` overrides, as the
    CLI will load it: PathOutsideRoots naming the field (and the `--set` that gave it) for
    one outside the roots (a path only read: and the shipped data) or in the app's own
    folder."""
    from difftune.config import load_config

    overrides = option_values(args, "--set")
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
            raise PathOutsideRoots(f"{_origin(field, path, config, overrides)}: {err}") from None


def _origin(field: str, path: Path, config: Path, overrides: list[str]) -> str:
    """Where a config path came from, for the refusal: the `--set` whose value names it, or
    the run file's field."""
    for item in overrides:
        value = item.partition("=")[2].strip().strip("\"'")
        try:
            if value and (config.parent / Path(value).expanduser()).resolve() == path.resolve():
                return f"--set {item} ({field})"
        except (OSError, RuntimeError):  # (no home folder for ~, a loop of links)
            continue
    return f"{field} = {path} in the run file {config}"
