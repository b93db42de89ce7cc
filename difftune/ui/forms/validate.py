"""Live validation of the form: the CLI's own parser and checks, so the app shows the message
`difftune check` prints for the same file (word for word, after its `error: `)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from difftune.config.load import parse_config
from difftune.config.run import RunConfig
from difftune.errors import DifftuneError
from difftune.ui.forms import toml_io


@dataclass
class Validation:
    """The outcome: `message` is the CLI's error text (None when the config is valid);
    `warnings` the options the CLI would warn about as ignored."""

    ok: bool
    message: str | None = None
    warnings: list[str] = field(default_factory=list)
    config: RunConfig | None = None


class _Collect(logging.Handler):
    """Keeps the warning lines `parse_config` logs (options set but ignored)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def validate(text: str, base: Path, source: str = "run.toml") -> Validation:
    """Validate run-file `text` as `load_config` would a file named `source` in folder `base`
    (relative paths resolve against `base`, and model files and output folders are checked)."""
    collect = _Collect()
    log = logging.getLogger("difftune")
    log.addHandler(collect)
    try:
        doc = toml_io.parse(text, source)
        cfg = parse_config(toml_io.plain(doc), base, source)
    except DifftuneError as err:
        return Validation(ok=False, message=str(err), warnings=collect.lines)
    finally:
        log.removeHandler(collect)
    return Validation(ok=True, warnings=collect.lines, config=cfg)
