"""The search space of `difftune sweep` (a TOML file), checked whole before any trial starts.

```toml
[sweep]
trials = 8              # how many trials the study holds when done
sampler = "tpe"         # grid | random | tpe (Optuna's samplers)
metric = "val_loss"     # any save.keep_best expression: what a trial is judged by
pruner = "median"       # median | none: stop trials early on the metric's intermediate values

[space]
"train.lr" = { low = 1e-4, high = 1e-2, log = true }
"adapter.rank" = { choices = [4, 8, 16] }
"train.steps" = { low = 200, high = 800, step = 200 }
```
A field is any dotted config field, as `--set` takes it. Every value a trial could take (each
choice, each range's ends; every combination for a grid) is applied to the run file and
validated as the run would be: an unknown field, a value the config refuses or an empty range
is a `ConfigError` naming it (exit 2) before anything runs.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from difftune.config.base import Section
from difftune.config.errors import format_validation_error
from difftune.config.keep_best import Measure
from difftune.config.load import load_config
from difftune.errors import ConfigError

Value = bool | int | float | str
MAX_CHECKED = 256  # grid combinations validated one by one (above: each value on its own)


class Dimension(Section):
    """One field's values: `choices`, or a range `low`..`high` (ints stepped by `step`,
    floats on a log scale with `log`)."""

    choices: list[Value] | None = None
    low: int | float | None = None  # ints (as written) make an integer range
    high: int | float | None = None
    step: int | float | None = Field(None, gt=0)
    log: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> "Dimension":
        if self.choices is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either choices or low/high, not both")
            if not self.choices:
                raise ValueError("choices is empty: give at least one value")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give choices = [...] or both low and high")
        if self.low > self.high:
            raise ValueError(f"the range is empty (low {self.low:g} > high {self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError("log = true needs low > 0")
        return self

    @property
    def integer(self) -> bool:
        """A range of integers (both ends and the step written as integers)."""
        return self.choices is None and all(
            isinstance(v, int) and not isinstance(v, bool) for v in (self.low, self.high,
                                                                    self.step or 1))

    def values(self) -> list[Value]:
        """The values a grid takes: the choices, or an integer / stepped range's points."""
        if self.choices is not None:
            return list(self.choices)
        if self.step is None and not self.integer:
            return []  # a continuous range: no grid
        assert self.low is not None and self.high is not None
        step = self.step or 1
        n = int(math.floor((self.high - self.low) / step + 1e-9)) + 1
        points = [self.low + i * step for i in range(n)]
        return [int(p) for p in points] if self.integer else points

    def ends(self) -> list[Value]:
        """The values checked up front: every choice, or the range's two ends."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None
        return [int(self.low), int(self.high)] if self.integer else [self.low, self.high]


class SweepSettings(Section):
    """The `[sweep]` table."""

    trials: int = Field(8, ge=1, description="Trials the study holds when done.")
    sampler: Literal["grid", "random", "tpe"] = "tpe"
    metric: str = Field("val_loss", description="A save.keep_best expression.")
    pruner: Literal["median", "none"] = "median"
    seed: int = 0
    storage: str | None = Field(None, description="An Optuna storage URL (default: SQLite "
                                "study.db in the sweep folder); an RDB URL shares a study.")
    study: str | None = Field(None, description="Study name (default: the run's save.name).")


class SpaceFile(Section):
    """A whole search-space file."""

    sweep: SweepSettings = Field(default_factory=SweepSettings)
    space: dict[str, Dimension] = Field(..., min_length=1)


def render(value: Value) -> str:
    """A value as `--set` reads it back (TOML literals; strings quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def overrides(params: dict[str, Value]) -> list[str]:
    """`--set` items of one trial's values."""
    return [f"{k}={render(v)}" for k, v in params.items()]


def read_space(path: Path) -> SpaceFile:
    """Parse a space file (ConfigError naming the file and every problem)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(f"--space {path}: cannot be read as TOML ({err})") from None
    try:
        space = SpaceFile.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, f"--space {path}", SpaceFile)) from None
    try:
        Measure(space.sweep.metric)
    except ValueError as err:
        raise ConfigError(f"--space {path}: sweep.metric: {err}") from None
    if space.sweep.sampler == "grid":
        flat = [k for k, d in space.space.items() if not d.values()]
        if flat:
            raise ConfigError(f"--space {path}: sampler = \"grid\" needs a finite set for "
                              f"{', '.join(flat)}: give choices, or a step")
    return space


def check_space(config: Path, space: SpaceFile, base: list[str]) -> None:
    """Validate the trials' configs up front: every grid combination (up to MAX_CHECKED),
    else each dimension's values with the others as the run file has them."""
    dims = space.space
    if space.sweep.sampler == "grid" and math.prod(len(d.values()) for d in dims.values()) \
            <= MAX_CHECKED:
        combos = [dict(zip(dims, c)) for c in itertools.product(*(d.values()
                                                                   for d in dims.values()))]
    else:
        combos = [{k: v} for k, d in dims.items() for v in d.ends()]
    for params in combos:
        try:
            load_config(config, [*base, *overrides(params)])
        except ConfigError as err:
            named = ", ".join(f"{k} = {render(v)}" for k, v in params.items())
            raise ConfigError(f"the search space gives {named}, which the run refuses:\n"
                              f"{err}") from None


def suggest(trial: Any, space: SpaceFile) -> dict[str, Value]:
    """One trial's values, drawn through Optuna's suggest API."""
    out: dict[str, Value] = {}
    for name, d in space.space.items():
        if d.choices is not None:
            out[name] = trial.suggest_categorical(name, d.choices)
        elif d.integer:
            out[name] = trial.suggest_int(name, int(d.low), int(d.high),  # type: ignore[arg-type]
                                          step=int(d.step or 1), log=d.log)
        else:
            out[name] = trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
    return out


def grid(space: SpaceFile) -> dict[str, list[Value]]:
    """Optuna's GridSampler search space."""
    return {k: d.values() for k, d in space.space.items()}
