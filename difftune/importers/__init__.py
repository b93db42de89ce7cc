"""Other trainers' config files as difftune run files (`difftune import`).

One module per trainer, each with `parse(text) -> mapping` (ValueError for bad syntax) and
`translate(mapping, path, translation)` (ConfigError for a file that is no config of that
trainer); `notes` holds the translation and its report, `values` the shared conversions,
`families` which difftune family each trainer's model names mean, `write` the TOML output.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# trainer name on the command line -> (module, what its files are)
TRAINERS: dict[str, tuple[str, str]] = {
    "kohya": ("difftune.importers.kohya", "a kohya sd-scripts training config (TOML)"),
    "ai-toolkit": ("difftune.importers.ai_toolkit", "an ai-toolkit job (YAML)"),
    "onetrainer": ("difftune.importers.onetrainer", "a OneTrainer training config (JSON)"),
}


def reader(trainer: str) -> ModuleType:
    """The module reading `trainer`'s files."""
    return importlib.import_module(TRAINERS[trainer][0])
