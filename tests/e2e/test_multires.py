"""A multi-resolution run through the real CLI: it trains at both sides, caches a latent per
image and side (reused by another run), and a stopped-and-resumed run equals an uninterrupted
one."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from difftune.cli import main

from .conftest import run_toml, stopped_and_resumed

MULTI = ["datasets.0.resolution=[64, 96]", 'cache.latents="disk"', 'datasets.0.crop="random"']


def _latents(cache: Path) -> dict[str, list[int]]:
    """Each latent entry's bucket, by key."""
    out = {}
    for path in (cache / "latents").rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            out[path.stem] = f.metadata()["bucket"]
    return out


def test_a_two_resolution_run_caches_both_and_resumes_exactly(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (run_toml(tmp_path / n, images, steps=4) for n in "ab")
    whole, resumed = stopped_and_resumed(a, b, monkeypatch, 2, *MULTI)
    assert whole == resumed and len(whole) == 4
    cache = tmp_path / "a" / "out" / "cache"
    buckets = _latents(cache)
    assert len(buckets) == 12  # 6 images at 64 and at 96
    assert sorted(set(buckets.values())) == ["[64, 64]", "[96, 96]"]
    from difftune.families.flux.family import FluxFamily
    encoded: list[int] = []
    real = FluxFamily.encode_images
    monkeypatch.setattr(FluxFamily, "encode_images",
                        lambda fam, c, px: encoded.append(1) or real(fam, c, px))
    sets = [a for s in MULTI for a in ("--set", s)]
    c = run_toml(tmp_path / "c", images, steps=4)  # another run with the same cache folder
    assert main(["cache", str(c), "--no-progress", *sets,
                 "--set", f'cache.dir="{cache.as_posix()}"']) == 0
    assert encoded == [] and _latents(cache) == buckets
