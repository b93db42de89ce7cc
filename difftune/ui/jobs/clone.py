"""A copy of a training that trains into a run folder of its own: "Duplicate" of a train job.

Re-running a training into its own run folder fails on the results it left there (the CLI
never overwrites them), so the copy is a new run file, written beside the original (its
relative paths keep meaning the same files), with `save.dir` naming a new folder beside the
original run folder and `save.name` a new name: `<name>-2`, `-3`, ... (a name that already
ends in `-N` counts on from its stem), the first number whose run file and run folder are
both free. The original file is never changed, and no file is ever overwritten.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from difftune.config.sections import SaveConfig
from difftune.ui.forms import toml_io
from difftune.ui.jobs.rules import save_table
from difftune.ui.limits import read_text
from difftune.ui.security import Roots

NUMBERED = re.compile(r"-\d+$")
MAX_COPIES = 10_000
# What a copy's arguments leave out: the run it continued (the new folder has none) and
# overrides of the fields the copy's run file now sets.
DROPPED_SETS = ("save.dir", "save.name")


def stem(name: str) -> str:
    """`name` without a trailing `-N` (the copies of `tiny-2` are `tiny-3`, ...)."""
    return NUMBERED.sub("", name) or name


def free_folder(base: Path, taken: set[Path]) -> Path:
    """`base` itself when nothing is there and no job uses it, else `<base>-2`, `-3`, ...:
    the first such folder (the new-run form's default never lands on an existing run)."""
    for n in range(1, MAX_COPIES):
        folder = base if n == 1 else base.parent / f"{stem(base.name)}-{n}"
        if not folder.exists() and folder not in taken:
            return folder
    raise ValueError(f"no free folder name beside {base} (tried {MAX_COPIES}); clean up old runs")


def copy_args(args: list[str]) -> list[str]:
    """A copy's CLI arguments: the original's without `--resume` and without the `--set`
    overrides of save.dir and save.name."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(args):
        if skip:
            skip = False
            continue
        name, eq, value = arg.partition("=")
        if name == "--resume":
            skip = not eq
            continue
        if name == "--set":
            item = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if item.partition("=")[0].strip() in DROPPED_SETS:
                skip = not eq
                continue
        out.append(arg)
    return out


def clone(config: Path, args: list[str], run_dir: Path, roots: Roots,
          taken: set[Path]) -> tuple[Path, list[str]]:
    """Write the copy of the run file `config` (run folder `run_dir`, as the job's `args`
    make it) and return its path and the copy's arguments. The copy's file and folder lie
    under the roots (PathOutsideRoots otherwise) and are new: not on disk, and no job in
    `taken` uses the folder. Bad TOML is a ConfigError; no free name, a ValueError."""
    text = read_text(config, "run file")
    doc = toml_io.parse(text, str(config))
    save = save_table(config, args)
    name = save.get("name") if isinstance(save.get("name"), str) else \
        SaveConfig.model_fields["name"].default
    absolute = Path(str(save.get("dir", ""))).expanduser().is_absolute()
    for n in range(2, MAX_COPIES):
        folder = run_dir.parent / f"{stem(run_dir.name)}-{n}"
        target = config.parent / f"{stem(config.stem)}-{n}{config.suffix}"
        if folder.exists() or target.exists() or folder in taken:
            continue
        roots.resolve(folder, write=True)
        roots.resolve(target, write=True)
        toml_io.set_value(doc, "save.dir",
                          str(folder) if absolute else os.path.relpath(folder, config.parent))
        toml_io.set_value(doc, "save.name", f"{stem(name)}-{n}")
        try:
            with open(target, "x", encoding="utf-8", newline="") as f:  # never overwrite
                f.write(toml_io.dumps(doc))
        except FileExistsError:
            continue  # made since we looked: the next number
        return target, copy_args(args)
    raise ValueError(f"no free name for a copy of {config} (tried {MAX_COPIES}); clean up old "
                     "runs")
