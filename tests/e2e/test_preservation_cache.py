"""Output preservation's trigger-free captions are cached with the others, and kept by
`difftune cache --prune`."""

from __future__ import annotations

from pathlib import Path

import pytest

from difftune.cli import main
from tests.e2e.conftest import run_toml

SETS = ['datasets.0.caption_prefix="zqx"', 'cache.text="disk"', 'cache.latents="disk"',
        'preservation.trigger="zqx"']


def _cache(cfg: Path, *extra: str) -> int:
    args = ["cache", str(cfg), "--no-progress"] + [a for s in SETS for a in ("--set", s)]
    return main(args + list(extra))


def test_trigger_free_captions_are_cached_and_kept_by_prune(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images)
    assert _cache(cfg) == 0
    capsys.readouterr()
    assert _cache(cfg, "--prune") == 0  # the twins are wanted: nothing to delete
    assert "pruned text: 0 unused entries deleted" in capsys.readouterr().out
    # Without preservation the six twins (one entry per text encoder) are no longer wanted.
    assert _cache(cfg, "--prune", "--set", 'preservation.trigger=""') == 0
    out = capsys.readouterr().out
    assert "pruned text: 12 unused entries deleted" in out, out
