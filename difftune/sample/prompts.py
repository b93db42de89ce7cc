"""Sample prompt files: kohya-style `.txt` lines or `.toml` tables, read afresh at every event.

`.txt`: one prompt a line, `#` starts a comment, options `--w --h` (size), `--s` (steps), `--d`
(seed), `--g` (distilled guidance), `--l` (CFG scale), `--n` (negative prompt), `--f` (frames:
a video family samples a clip, written as mp4 and an animated WebP), `--ci` (an
input image for edit models, repeated for several, relative to the prompt file):
`a red circle --n blurry --w 512 --h 512 --s 20 --d 42 --g 3.5 --l 1.0`.
`.toml`: one `[[prompts]]` table a prompt, with `prompt` and the same options by name
(`negative`, `width`, `height`, `steps`, `seed`, `guidance`, `cfg`, `frames`, `images`). A bad
line or table, or one naming an input image that does not exist, is skipped with a warning
naming the file and line (or table); a missing or empty file is a warning and no samples.
Nothing here raises: a prompt file edited mid-run can never stop training.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tomllib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("difftune")

_OPTIONS = {"w": ("width", int), "h": ("height", int), "s": ("steps", int), "d": ("seed", int),
            "g": ("guidance", float), "l": ("cfg", float), "n": ("negative", str),
            "f": ("frames", int)}


@dataclass(frozen=True)
class PromptSpec:
    """One prompt to sample, with every option resolved."""

    prompt: str
    negative: str
    width: int
    height: int
    steps: int
    seed: int
    guidance: float
    cfg: float
    images: tuple[Path, ...] = ()
    frames: int = 1  # a video family's clip length (1: an image)


def parse_line(line: str, default: PromptSpec) -> PromptSpec:
    """Parse one prompt line; raises ValueError naming the bad option."""
    parts = re.split(r"\s--(?=[a-zA-Z])", " " + line)
    spec = replace(default, prompt=parts[0].strip())
    for part in parts[1:]:
        flag, _, value = part.partition(" ")
        if flag == "ci":
            if not value.strip():
                raise ValueError("--ci needs an image path")
            spec = replace(spec, images=spec.images + (Path(value.strip()),))
            continue
        if flag not in _OPTIONS:
            raise ValueError(f"unknown option --{flag} (known: --w --h --s --d --g --l --n "
                             "--f --ci)")
        field, kind = _OPTIONS[flag]
        try:
            spec = replace(spec, **{field: kind(value.strip())})
        except ValueError:
            raise ValueError(f"--{flag} needs a {kind.__name__}, got {value.strip()!r}") from None
    if not spec.prompt:
        raise ValueError("empty prompt")
    return spec


MAX_BYTES = 1 << 20  # a prompt file is text someone wrote; anything bigger is a mistake


def _read_regular(path: Path) -> str:
    """The text of a regular file of at most `MAX_BYTES`, opened without blocking (a FIFO or
    a device named as the prompt file must never hang training); raises OSError otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file ({_kind(os.fstat(fd).st_mode)})")
        data = os.read(fd, MAX_BYTES + 1)
        while data and len(data) <= MAX_BYTES and (more := os.read(fd, MAX_BYTES + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise OSError(f"larger than {MAX_BYTES // 2**20} MiB")
    return data.decode("utf-8-sig")


def _kind(mode: int) -> str:
    """What a non-regular file is, in a word."""
    for test, word in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a folder")):
        if test(mode):
            return word
    return "not a file"


def read_prompts(path: Path, default: PromptSpec) -> list[PromptSpec]:
    """All valid prompts of a `.txt` or `.toml` file; bad entries are skipped with a warning."""
    try:
        raw = _read_regular(path)
    except FileNotFoundError:
        log.warning("sample prompt file %s does not exist; no samples this time", path)
        return []
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else err
        log.warning("sample prompt file %s cannot be read (%s); no samples this time", path, why)
        return []
    reader = _read_toml if path.suffix.lower() == ".toml" else _read_txt
    specs = reader(path, raw, default)
    if not specs:
        log.warning("sample prompt file %s holds no prompts; no samples this time", path)
    return specs


def _read_txt(path: Path, raw: str, default: PromptSpec) -> list[PromptSpec]:
    """Prompts of a kohya-style text file, one a line."""
    specs = []
    for number, line in enumerate(raw.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            specs.append(with_images(parse_line(line, default), path.parent))
        except ValueError as err:
            log.warning("%s:%d: skipped prompt line: %s", path, number, err)
    return specs


def with_images(spec: PromptSpec, base: Path) -> PromptSpec:
    """The spec with its input images resolved against `base` (the prompt file's folder);
    raises ValueError naming an image that is not a file."""
    images = tuple(p if p.is_absolute() else base / p for p in spec.images)
    missing = [str(p) for p in images if not p.is_file()]
    if missing:
        raise ValueError(f"input image {missing[0]} does not exist")
    return replace(spec, images=images)


_TOML_FIELDS = {f.name for f in fields(PromptSpec)}


def _read_toml(path: Path, raw: str, default: PromptSpec) -> list[PromptSpec]:
    """Prompts of a TOML file: `[[prompts]]` tables (`prompt` plus options by name)."""
    try:
        data = tomllib.loads(raw)
    except tomllib.TOMLDecodeError as err:
        log.warning("%s: not valid TOML (%s); no samples this time", path, err)
        return []
    tables = data.get("prompts", [])
    if not isinstance(tables, list) or set(data) - {"prompts"}:
        log.warning("%s: expected only [[prompts]] tables; found %s", path, sorted(data))
        tables = tables if isinstance(tables, list) else []
    specs = []
    for i, table in enumerate(tables):
        try:
            specs.append(with_images(_toml_spec(table, default), path.parent))
        except (ValueError, TypeError) as err:
            log.warning("%s: prompts[%d] skipped: %s", path, i, err)
    return specs


def _toml_spec(table: Any, default: PromptSpec) -> PromptSpec:
    """One `[[prompts]]` table as a PromptSpec; raises ValueError naming the bad field."""
    if not isinstance(table, dict):
        raise ValueError("not a table")
    unknown = set(table) - _TOML_FIELDS
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)} (known: {sorted(_TOML_FIELDS)})")
    values: dict[str, Any] = {}
    for name, value in table.items():
        if name == "images":
            values[name] = _toml_images(value)
            continue
        kind = type(getattr(default, name))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not kind:
            raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
        values[name] = value
    spec = replace(default, **values)
    if not spec.prompt.strip():
        raise ValueError("empty prompt")
    return spec


def _toml_images(value: Any) -> tuple[Path, ...]:
    """A table's `images`: one path or a list of paths (strings)."""
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"images must be a path or a list of paths, got {value!r}")
    return tuple(Path(v) for v in value)
