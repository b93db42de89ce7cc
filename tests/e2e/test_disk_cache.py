"""Disk caches through the real CLI: reuse, edits, resolution changes, corruption, a killed fill,
prune, and lookups by item whatever the order."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from difftune.cli import main
from difftune.config import load_config
from difftune.data.images import load_pixels
from difftune.data.sampler import BucketBatchSampler
from difftune.families.common import text
from difftune.train.setup import fill_caches, prepare

from .conftest import run_toml

DISK = '\n[cache]\nlatents = "disk"\ntext = "disk"\n'


@pytest.fixture()
def data(tmp_path: Path, images: Path) -> Path:
    """A private copy of the images (tests edit captions)."""
    return Path(shutil.copytree(images, tmp_path / "data"))


def config(folder: Path, data: Path, extra: str = "", steps: int = 2) -> Path:
    return run_toml(folder, data, extra=DISK + extra, steps=steps)


def entries(cache: Path, kind: str) -> dict[str, Path]:
    return {p.stem: p for p in (cache / kind).rglob("*.safetensors")}


def cli(*args: str) -> int:
    return main([*args, "--no-progress"])


class Calls:
    """Counts VAE and text-encoder calls made in-process."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from difftune.families.flux.family import FluxFamily

        self.images = 0
        self.texts: list[str] = []
        real_images, real_text = FluxFamily.encode_images, text.encode

        def images(fam: object, c: object, pixels: torch.Tensor) -> torch.Tensor:
            self.images += 1
            return real_images(fam, c, pixels)

        def encode(spec: object, model: object, tok: object, texts: list[str], *a: object,
                   **k: object) -> dict[str, torch.Tensor]:
            self.texts += texts
            return real_text(spec, model, tok, texts, *a, **k)

        monkeypatch.setattr(FluxFamily, "encode_images", images)
        monkeypatch.setattr(text, "encode", encode)


def test_cache_verb_fills_and_train_reuses(tmp_path: Path, data: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, data)
    assert cli("cache", str(cfg)) == 0
    out = capsys.readouterr().out
    cache = tmp_path / "out" / "cache"
    assert len(entries(cache, "latents")) == 6 and len(entries(cache, "text")) == 2 * 6
    assert "latents: 6 entries" in out
    with safe_open(str(next(iter(entries(cache, "text").values()))), "pt") as f:
        meta = f.metadata()
    assert meta["kind"] == "text" and meta["caption"] in {p.read_text().strip() for p in data.glob("*.txt")}
    calls = Calls(monkeypatch)
    assert cli("train", str(cfg)) == 0
    assert calls.images == 0 and calls.texts == []  # everything came from the disk cache


def test_caption_edit_gives_a_new_embedding(tmp_path: Path, data: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path, data)
    assert cli("cache", str(cfg)) == 0
    (data / "pink_ring.txt").write_text("a pink donut on a gray background")
    calls = Calls(monkeypatch)
    assert cli("train", str(cfg), "--set", "save.overwrite=true") == 0
    # Only the edited caption was encoded (once per encoder); the old entry is never read.
    assert calls.texts == ["a pink donut on a gray background"] * 2 and calls.images == 0
    captions = set()
    for path in entries(tmp_path / "out" / "cache", "text").values():
        with safe_open(str(path), "pt") as f:
            captions.add(f.metadata()["caption"])
    assert "a pink donut on a gray background" in captions


def test_resolution_change_makes_new_latents(tmp_path: Path, data: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(tmp_path, data)
    assert cli("cache", str(cfg)) == 0
    before = set(entries(tmp_path / "out" / "cache", "latents"))
    calls = Calls(monkeypatch)
    assert cli("cache", str(cfg), "--set", "datasets.0.resolution=80") == 0
    after = set(entries(tmp_path / "out" / "cache", "latents"))
    assert calls.images == 6 and len(after - before) == 6 and before <= after


def test_corrupt_entries_are_recomputed_with_one_warning(
        tmp_path: Path, data: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = config(tmp_path, data)
    assert cli("cache", str(cfg)) == 0
    cache = tmp_path / "out" / "cache"
    latents = sorted(entries(cache, "latents").values())
    for path in latents[:2]:  # truncated (a killed write or a full disk): found while filling
        path.write_bytes(path.read_bytes()[:100])
    blob = bytearray(latents[2].read_bytes())
    blob[-3] ^= 0xFF  # a flipped bit in the data: found when the entry is read
    latents[2].write_bytes(bytes(blob))
    with caplog.at_level(logging.WARNING, logger="difftune"):
        assert cli("train", str(cfg), "--set", "train.steps=6") == 0
    warnings = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one for the fill, one for the run
    assert warnings[0].startswith("2 ") and warnings[1].startswith("1 ")
    assert str(latents[0]) in warnings[0] and str(latents[2]) in warnings[1]
    assert len(entries(cache, "latents")) == 6  # all rewritten


def test_killed_fill_then_train_completes(tmp_path: Path, data: Path) -> None:
    for i in range(80):  # many (distinct) images so the fill takes a while
        Image.new("RGB", (64, 64), (3 * i, 255 - 3 * i, 100)).save(data / f"flat_{i:02d}.png")
        (data / f"flat_{i:02d}.txt").write_text(f"a flat color number {i}")
    cfg = config(tmp_path, data)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    log = (tmp_path / "fill.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "difftune", "cache", str(cfg), "--no-progress"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    cache = tmp_path / "out" / "cache"
    deadline = time.time() + 120
    while time.time() < deadline and len(entries(cache, "latents")) < 3 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    log.close()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "fill.log").read_text()[-2000:]
    assert 0 < len(entries(cache, "latents")) < 86
    assert cli("train", str(cfg)) == 0
    assert len(entries(cache, "latents")) == 86


def test_prune_deletes_only_unreferenced_entries(tmp_path: Path, data: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, data)
    assert cli("cache", str(cfg), "--set", "datasets.0.resolution=80") == 0
    old = set(entries(tmp_path / "out" / "cache", "latents"))
    assert cli("cache", str(cfg)) == 0
    capsys.readouterr()
    assert cli("cache", str(cfg), "--prune") == 0
    out = capsys.readouterr().out
    left = set(entries(tmp_path / "out" / "cache", "latents"))
    assert len(left) == 6 and not (left & old)
    assert "pruned latents: 6 unused entries deleted" in out and "MiB freed" in out
    assert "pruned text: 0 unused entries deleted" in out


def test_cache_verb_needs_a_disk_cache(tmp_path: Path, data: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, data)
    assert cli("cache", str(cfg)) == 2
    assert 'cache.latents = "disk"' in capsys.readouterr().err


def test_batches_get_their_own_items_entries(tmp_path: Path, data: Path) -> None:
    """Shuffled, multi-epoch batches: every latent and embedding belongs to its batch's item."""
    cfg = load_config(config(tmp_path, data))
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    sampler = BucketBatchSampler(run.data, 2, seed=11)
    batches = sampler.batches()
    for _ in range(3 * sampler.len_epoch):
        batch = next(batches)
        for i in batch.indices:
            item = run.data.items[i]
            pixels = load_pixels(item.path, item.bucket, run.latents.box(i), False)[None]
            direct = run.family.encode_images(run.comps, pixels)[0].float()
            assert torch.equal(run.latents.get(i, False), direct)
            with torch.no_grad():
                own = run.family.encode_text(run.comps, [item.caption])
            got = run.texts.get([run.captions.text(i, None, 0)])
            for k, v in own.tensors.items():
                assert torch.equal(got.tensors[k], v), (item.path, k)
