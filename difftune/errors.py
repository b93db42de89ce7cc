"""User-facing failures.

Every problem a user can fix (a config value, a data folder, a model file, a checkpoint, the
environment) is raised as one of these. The CLI prints the message alone, without a traceback,
and exits non-zero; the full traceback goes to the run log. `assert` stays for internal
invariants only.
"""

from __future__ import annotations


class DifftuneError(Exception):
    """Base of every user-fixable failure: the message names the thing and the fix."""

    exit_code: int = 2


class ConfigError(DifftuneError):
    """The run configuration is invalid or self-contradictory."""


class DataError(DifftuneError):
    """A dataset folder, image or caption cannot be used."""


class ModelFileError(DifftuneError):
    """A model file or folder is missing, of the wrong kind, or unsafe to load."""


class CheckpointError(DifftuneError):
    """A checkpoint or LoRA file cannot be read or does not match the run."""


class EnvironmentProblem(DifftuneError):
    """The machine lacks something the run needs (a device, a package, disk space)."""


class NonFiniteError(DifftuneError):
    """Weights to be written, or a file's tensors to be used, hold NaN or inf."""
