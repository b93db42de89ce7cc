"""Shared test set-up: offline everywhere, quiet libraries, and the two test tiers.

Tiers: the default run (`python -m pytest -q`, what CI runs) executes every behaviour at least
once; cases marked `full_only` are extra samples of a slow grid whose behaviours the default
cases already cover (each module that marks cases says how it samples). `--full` runs them too.
They are deselected, not skipped, so a default run reports them as deselected."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from difftune.report.logs import quiet_libraries  # noqa: E402

quiet_libraries()


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--full`: also run the `full_only` cases (every cell of the slow grids)."""
    parser.addoption("--full", action="store_true", default=False,
                     help="run every case, including the full_only samples of slow grids")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without `--full`, deselect the `full_only` cases."""
    if config.getoption("--full"):
        return
    kept = [i for i in items if i.get_closest_marker("full_only") is None]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


from tests.slurm_cluster import slurm_cluster  # noqa: E402,F401  (a session fixture: one SLURM)


@pytest.fixture(scope="session")
def scorer_models(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """Folders of a tiny random DINOv2 and CLIP (real transformers classes, offline
    processors): what `[metrics]` points at in tests."""
    from difftune.report.tiny_scorers import save_tiny_clip, save_tiny_dino

    base = tmp_path_factory.mktemp("scorers")
    return save_tiny_dino(base / "dino"), save_tiny_clip(base / "clip")
