"""Each family's text-encoder set-up through the real CLI: FLUX.1 (CLIP+T5), SD3 (CLIP+CLIP+T5),
SDXL (CLIP+CLIP), with text caching on and off, no encoder trained and the last one (T5 where
there is one) trained; unsupported combinations refused before anything loads.

Tiers: the family x caching x trained grid runs by default what is each family's own fact, its
last encoder trained (the LoRA's text-encoder prefix and metadata, or the spec's refusal), for
every family, the caching values spread over them (`conftest.pairwise` of the trained cells,
family x caching pairs not required); the untrained runs, the same code for every family
(and run for every family by the contract suite), by default for the first family in registry
order with caching on and off. `pytest --full` runs every cell (families x 2 x 2)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from difftune import families
from difftune.cli import main

from .conftest import pairwise, run_toml



def last_encoder(family: str) -> tuple[str, str]:
    """The family's last declared text encoder and the pipeline component its keys start with."""
    spec = families.spec(family)
    name = spec.text_encoders[-1].name
    return name, spec.text_encoder_prefixes[name]


def toml(folder: Path, images: Path, family: str, fmt: str = "diffusers") -> Path:
    """The shared tiny run file (2 steps) switched to `family`."""
    return run_toml(folder, images, steps=2, fmt=fmt, family=family)


CELLS = list(itertools.product(families.names(), ["memory", "none"], [False, True]))


def tiers(cells: list[tuple[str, str, bool]]) -> list[object]:
    """`cells` as parametrize values: by default the all-pairs cover of the trained cells
    (family x caching pairs skipped) and the first family's untrained cells, the rest
    `full_only`."""
    first = families.names()[0]
    keep = pairwise([c for c in cells if c[2]], skip=((0, 1),))
    keep += [c for c in cells if not c[2] and c[0] == first]
    return [c if c in keep else pytest.param(*c, marks=pytest.mark.full_only) for c in cells]


@pytest.mark.parametrize("family, cache, trained", tiers(CELLS))
def test_setup_trains(tmp_path: Path, images: Path, family: str, cache: str,
                      trained: bool, capsys: pytest.CaptureFixture[str]) -> None:
    name, prefix = last_encoder(family)
    args = ["train", str(toml(tmp_path, images, family)), "--no-progress",
            "--set", f'cache.text="{cache}"']
    if trained:
        args += ["--set", f'adapter.text_encoders=["{name}"]']
    refused = dict(families.spec(family).text_encoder_lora_refused).get(name)
    if trained and refused:  # a LoRA no reader of the family's files could load
        assert main(args) == 2
        assert refused in capsys.readouterr().err
        return
    assert main(args) == 0
    out = tmp_path / "out"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    tensors = load_file(str(out / "lora.safetensors"))
    components = {k.split(".")[0] for k in tensors}
    assert components == ({"transformer", "unet"} & components) | ({prefix} if trained else set())
    if trained:
        assert any(torch.count_nonzero(v) for k, v in tensors.items()
                   if k.startswith(prefix) and "lora_B" in k)
        with safe_open(str(out / "lora.safetensors"), "pt") as f:
            assert json.loads(f.metadata()["difftune.text_encoders"]) == [name]


@pytest.mark.parametrize("family, sets, needle", [
    ("flux", ['adapter.text_encoders=["clip_g"]'], "choose from clip_l, t5"),
    ("sdxl", ['adapter.text_encoders=["t5"]'], "choose from clip_l, clip_g"),
    ("sdxl", ["model.t5_mask=true"], "no T5 encoder"),
    ("flux", ["model.clip_skip=2"], "nothing to skip"),
    ("flux", ['adapter.text_encoders=["clip_l"]', 'save.format="kohya"'], "transformer only"),
    ("sd3", ['adapter.text_encoders=["t5"]', 'save.format="kohya"'], "no kohya key layout"),
])
def test_unsupported_setup_refused_at_load(tmp_path: Path, images: Path,
                                           capsys: pytest.CaptureFixture[str], family: str,
                                           sets: list[str], needle: str) -> None:
    args = ["check", str(toml(tmp_path, images, family))]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_check_reports_gradient_flow_into_each_trained_encoder(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", str(toml(tmp_path, images, "sd3")), "--set",
            'adapter.text_encoders=["clip_l", "t5"]']
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradients flow into the denoiser, text encoder clip_l, text encoder t5" in out
