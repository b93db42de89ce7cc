"""`difftune import kohya|ai-toolkit|onetrainer FILE`: another trainer's config as a difftune
run file, with a report of what maps, what was guessed and what has no equivalent.

A run that difftune's own checks still refuse (a value out of range, a 4-bit base on a
machine without CUDA) is written all the same, with what to fix listed in it and printed.
Nothing a user made is overwritten: the run file and its prompt file are created new (an
existing one is refused unless --force), and the source file is never written.
"""

from __future__ import annotations

import logging
import os
import tempfile
import traceback
from pathlib import Path
from typing import Callable

from pydantic import ValidationError

from difftune.config.errors import format_validation_error
from difftune.config.run import RunConfig
from difftune.errors import ConfigError
from difftune.importers import TRAINERS, reader
from difftune.importers.notes import NoEquivalent, Translation
from difftune.importers.values import fit_schedule, fit_sides, other_objective
from difftune.importers.write import report, run_toml

log = logging.getLogger("difftune")


def _read(source: Path) -> str:
    """The source file's text, or a clear refusal."""
    if not source.is_file():
        raise ConfigError(f"{source} does not exist or is not a file; pass the other trainer's "
                          "config file")
    try:
        return source.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{source} is not a text file (not UTF-8); pass the config file") \
            from None
    except OSError as err:
        raise ConfigError(f"{source} cannot be read ({err.strerror}); check its permissions") \
            from None


def _targets(source: Path, out: Path | None, force: bool) -> tuple[Path, Path]:
    """The run file and its prompt file; refused when either exists (unless `force`) or
    either is the source file itself."""
    out = out or Path(f"{source.stem}.difftune.toml")
    prompts = out.with_name(f"{out.stem}.prompts.txt")
    for path in (out, prompts):
        if path.resolve() == source.resolve():
            raise ConfigError(f"{path} is the file being imported; choose another --out")
        if path.exists() and not force:
            raise ConfigError(f"{path} exists; choose another --out, or pass --force to "
                              "replace it")
        if path.is_dir():
            raise ConfigError(f"{path} is a folder; choose a file name with --out")
    return out, prompts


def _write(path: Path, text: str) -> None:
    """Write `text` atomically (a temporary file beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def problems(t: Translation) -> list[str]:
    """What difftune's own validation (schema and cross-field rules, the family's and this
    machine's included) still finds in the translated run: one line each, empty when none."""
    try:
        RunConfig.model_validate(t.data)
    except ValidationError as err:
        return format_validation_error(err, "run").splitlines()[1:]
    return []


def translate(trainer: str, source: Path, family: str | None, prompt_file: str) -> Translation:
    """The difftune run `source` (a `trainer` config) means, with its notes."""
    module = reader(trainer)
    try:
        data = module.parse(_read(source))
    except ValueError as err:
        raise ConfigError(f"{source}: {err}; pass {TRAINERS[trainer][1]}") from None
    t = Translation(trainer, base=source.resolve().parent, prompt_file=prompt_file)
    if family:
        t.put("model.family", family, f"--family {family}")
    try:
        module.translate(data, source, t)
    except (AttributeError, TypeError, ValueError, KeyError, NoEquivalent) as err:
        # A value of another shape than the trainer writes (a list where it writes a table,
        # text where it writes a number): said as the file's problem, the detail in the log.
        log.debug("import of %s failed:\n%s", source, traceback.format_exc())
        raise ConfigError(f"{source}: a value has another shape than {TRAINERS[trainer][1]} "
                          f"holds ({type(err).__name__}: {err}); fix that value") from None
    fit_sides(t)
    fit_schedule(t)
    other_objective(t)
    if not t.get("datasets"):
        t.put("datasets.0.path", "images", "(no dataset in the source)", "put your images "
              "(and .txt captions) in this folder beside the run file, or set the path")
    if t.get("save.dir") is None:
        t.put("save.dir", f"runs/{source.stem}", "(no output folder in the source)",
              "a folder beside the run file")
    return t


def run_import(trainer: str, source: Path, out: Path | None, force: bool = False,
               family: str | None = None, command: str = "difftune import",
               say: Callable[[str], None] = print) -> Path:
    """Import `source`, write the run file (and its prompt file), print the report; return
    the run file's path."""
    out, prompts = _targets(source, out, force)
    t = translate(trainer, source, family, prompts.name)
    todo = problems(t)
    if t.prompts:
        _write(prompts, "\n".join(t.prompts) + "\n")
    _write(out, run_toml(t, source, command, todo))
    say(f"imported {TRAINERS[trainer][1]} {source} -> {out}"
        + (f" (prompts: {prompts})" if t.prompts else ""))
    for line in report(t.notes):
        say(line)
    if todo:
        say(f"to fix in {out} before it trains (difftune's own checks):")
        for line in todo:
            say(line)
    say(f"next: difftune check {out}")
    return out
