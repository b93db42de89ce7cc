"""Every caption augmentation reaches the model, with text caching in memory, on disk and off.

The denoiser's text input is recorded at every step. For each augmentation: it differs from the
same run without the augmentation (nothing is silently ignored), and it is bitwise the same
whether text caching is on or off (the texts a sample sees never depend on caching).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from difftune.cli import main
from difftune.families.flux.family import FluxFamily

from .conftest import run_toml

AUGMENTATIONS = {
    "prefix": ['datasets.0.caption_prefix="photo of"'],
    "suffix": ['datasets.0.caption_suffix="high quality"'],
    "wildcards": ["datasets.0.wildcards=true"],
    "shuffle": ["datasets.0.shuffle_caption=true", "datasets.0.keep_tokens=1"],
    "tag_dropout": ["datasets.0.caption_tag_dropout_rate=0.5"],
    "caption_dropout": ["datasets.0.caption_dropout_rate=0.5"],
    "token_warmup": ["datasets.0.token_warmup_steps=3"],
}
CACHES = {"none": ['cache.text="none"'], "memory": ['cache.text="memory"'],
          "disk": ['cache.text="disk"', 'cache.latents="disk"']}


@pytest.fixture(scope="module")
def tagged(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """The demo images with tag-style captions holding a wildcard."""
    folder = Path(shutil.copytree(images, tmp_path_factory.mktemp("tagged") / "data"))
    for path in folder.glob("*.txt"):
        words = path.read_text().strip().replace(" on a ", ", ")
        path.write_text(f"sks, {words}, {{small|large}}, flat")
    return folder


def seen(tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch, sets: list[str],
         variants: int = 0) -> list[torch.Tensor]:
    """The text inputs the denoiser got at each training step of a 4-step run."""
    got: list[torch.Tensor] = []
    real = FluxFamily.predict

    def spy(self: FluxFamily, c: object, noisy: torch.Tensor, embeds: object, *a: object) -> object:
        got.append(embeds.tensors["prompt_embeds"].detach().clone())
        return real(self, c, noisy, embeds, *a)

    monkeypatch.setattr(FluxFamily, "predict", spy)
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = run_toml(tmp_path, data, steps=4)
    args = ["train", str(cfg), "--no-progress", "--set", f"cache.caption_variants={variants}"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 0
    monkeypatch.undo()
    return got


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, tagged: Path) -> list[torch.Tensor]:
    with pytest.MonkeyPatch.context() as mp:
        return seen(tmp_path_factory.mktemp("base"), tagged, mp, [])


@pytest.mark.parametrize("name", sorted(AUGMENTATIONS))
def test_augmentation_reaches_the_model_cached_or_not(
        name: str, tmp_path: Path, tagged: Path, baseline: list[torch.Tensor],
        monkeypatch: pytest.MonkeyPatch) -> None:
    runs = {cache: seen(tmp_path / cache, tagged, monkeypatch, AUGMENTATIONS[name] + sets)
            for cache, sets in CACHES.items()}
    for cache, steps in runs.items():
        assert len(steps) == len(baseline) == 4
        assert any(s.shape != b.shape or not torch.equal(s, b) for s, b in zip(steps, baseline)), \
            f"{name} changed nothing with cache.text = {cache}"
        for a, b in zip(steps, runs["none"]):
            assert torch.equal(a, b), f"{name}: cache.text = {cache} saw other texts than none"


@pytest.mark.parametrize("name", ["wildcards", "shuffle", "tag_dropout"])
def test_random_augmentations_with_pre_encoded_variants(
        name: str, tmp_path: Path, tagged: Path, baseline: list[torch.Tensor],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """K = 2 variants per caption, pre-encoded on disk: the same on or off, and not a no-op."""
    disk = seen(tmp_path / "disk", tagged, monkeypatch, AUGMENTATIONS[name] + CACHES["disk"], 2)
    off = seen(tmp_path / "off", tagged, monkeypatch, AUGMENTATIONS[name] + CACHES["none"], 2)
    assert all(torch.equal(a, b) for a, b in zip(disk, off))
    assert any(not torch.equal(s, b) for s, b in zip(disk, baseline))


def test_check_prints_how_captions_are_handled(tmp_path: Path, tagged: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, tagged)
    sets = AUGMENTATIONS["shuffle"] + AUGMENTATIONS["caption_dropout"] + ["cache.caption_variants=4"]
    args = ["check", str(cfg)] + [a for s in sets for a in ("--set", s)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "shuffle (keep 1)" in out and "caption dropout 0.5 (cached empty caption)" in out
    assert "4 variants per caption pre-encoded" in out
    assert main(["check", str(cfg), "--set", AUGMENTATIONS["shuffle"][0]]) == 0
    assert "encoded on demand" in capsys.readouterr().out
