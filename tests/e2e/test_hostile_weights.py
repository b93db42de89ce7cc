"""Bad weights and bad LoRA files refused with exit 2 (issue 14, items 9 and 13): diverged or
overflowing weights are never written, and `model.init_lora` / sampling refuse non-finite
weights and bad alpha metadata, each naming the file. Through the real CLI on the tiny flavor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main

from .conftest import lora_metadata, run_toml, train_cli

ALPHA = 3  # rank 4: scale 0.75


def train(folder: Path, images: Path, family: str, *sets: str, fmt: str | None = "diffusers",
          steps: int = 1, extra: str = "") -> Path:
    """A run through the CLI (rank 4, alpha 3 unless `sets` say otherwise); the output folder."""
    return train_cli(folder, images, f"adapter.alpha={ALPHA}", *sets, family=family, fmt=fmt,
                     steps=steps, extra=extra)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, images: Path) -> Path:
    """A finished FLUX.1 run (diffusers format) whose LoRA the tests below spoil."""
    return train(tmp_path_factory.mktemp("good"), images, "flux")


def test_diverged_weights_are_never_written(tmp_path: Path, images: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """An optimizer step that leaves a NaN in the LoRA (as a diverging run does, with a finite
    loss): exit 2, the tensor named, the fix given, and no LoRA file holding it left behind."""
    from difftune.train import loop

    real = loop._optimizer_step

    def diverging(opt, sched, scaler, params, max_grad_norm):  # type: ignore[no-untyped-def]
        lr = real(opt, sched, scaler, params, max_grad_norm)
        with torch.no_grad():
            params[0].view(-1)[0] = math.nan
        return lr

    monkeypatch.setattr(loop, "_optimizer_step", diverging)
    args = ["train", str(run_toml(tmp_path, images, family="flux", steps=1)), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "lora_" in err and "train.lr" in err, err
    assert "Traceback" not in err
    assert not [p for p in (tmp_path / "out").rglob("*.safetensors")
                if "lora" in p.name or p.name.startswith(".")]


def test_values_that_overflow_the_save_dtype_are_refused(tmp_path: Path, images: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """Finite fp32 weights too large for fp16: the message points at save.dtype."""
    args = ["train", str(run_toml(tmp_path, images, family="flux", steps=1)), "--no-progress",
            "--set", "train.lr=1e6", "--set", 'save.dtype="fp16"']
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "not finite" in err and "save.dtype" in err, err
    assert not list((tmp_path / "out").glob("*.safetensors"))


def _spoiled(good: Path, path: Path, value: float) -> Path:
    file = load_file(str(good / "lora.safetensors"))
    key = sorted(k for k in file if k.endswith("lora_B.weight"))[0]
    file[key] = file[key].clone()
    file[key].view(-1)[0] = value
    save_file(file, str(path), metadata=lora_metadata(good / "lora.safetensors"))
    return path


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_init_lora_with_non_finite_weights_is_refused(
        good: Path, tmp_path: Path, images: Path, value: float,
        capsys: pytest.CaptureFixture[str]) -> None:
    bad = _spoiled(good, tmp_path / "bad.safetensors", value)
    cfg = run_toml(tmp_path / "run", images, family="flux")
    assert main(["train", str(cfg), "--no-progress", "--init-lora", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not finite" in err and "lora_B" in err, err


def sample_refused(tmp_path: Path, images: Path, lora: Path,
                   capsys: pytest.CaptureFixture[str]) -> str:
    """`difftune sample` on the tiny FLUX.1 with `--lora lora`, which must exit 2; stderr."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 1\n")
    cfg = run_toml(tmp_path / "run", images, family="flux")
    assert main(["sample", str(cfg), "--lora", str(lora), "--prompts", str(prompts),
                 "--out", str(tmp_path / "pics")]) == 2
    return capsys.readouterr().err


def test_sample_with_a_non_finite_lora_is_refused(good: Path, tmp_path: Path, images: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    bad = _spoiled(good, tmp_path / "nan.safetensors", math.nan)
    err = sample_refused(tmp_path, images, bad, capsys)
    assert str(bad) in err and "not finite" in err, err
    assert not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize("alpha", ["abc", "nan", "inf", "0", "-2"])
def test_init_lora_with_bad_alpha_metadata_is_refused(
        good: Path, tmp_path: Path, images: Path, alpha: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "alpha.safetensors"
    meta = lora_metadata(good / "lora.safetensors") | {"difftune.alpha": alpha}
    save_file(load_file(str(good / "lora.safetensors")), str(bad), metadata=meta)
    cfg = run_toml(tmp_path / "run", images, family="flux")
    assert main(["train", str(cfg), "--no-progress", "--init-lora", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "difftune.alpha" in err and "Traceback" not in err, err


# A file made for another model: one tensor of each kind's file resized on one axis (the
# factor sizes that model's weights would give). LyCORIS failed inside with "The size of tensor
# a (16) must match the size of tensor b (3)" (exit 1); peft skipped a plain LoRA's module.
UNFIT = [
    pytest.param(["adapter.type=lora"], "lora_A.weight", 1, id="lora-diffusers"),
    pytest.param(["adapter.type=lora"], "lora_B.weight", 0, id="lora-rows"),
    pytest.param(["adapter.type=locon"], "lora_down.weight", 1, id="locon"),
    pytest.param(["adapter.type=loha"], "hada_w1_b", 1, id="loha"),
    pytest.param(["adapter.type=lokr", "adapter.rank=2"], "lokr_w2_b", 1, id="lokr"),
    pytest.param(["adapter.type=lokr", "adapter.rank=2"], "lokr_w1", 0, id="lokr-rows"),
    pytest.param(["adapter.dora=true"], "dora_scale", 0, id="dora"),
]


def _unfit(tmp_path: Path, images: Path, sets: list[str], suffix: str, axis: int
           ) -> tuple[Path, str, tuple[int, ...]]:
    """A FLUX.1 file of `sets`' kind whose first `suffix` tensor has size 3 on `axis`: the
    file, that tensor's key and its shape."""
    lycoris = sets != ["adapter.type=lora"]
    out = train(tmp_path / "a", images, "flux", *sets, fmt=None if lycoris else "diffusers")
    file = load_file(str(out / "lora.safetensors"))
    key = sorted(k for k in file if k.endswith("." + suffix))[0]
    shape = list(file[key].shape)
    shape[axis] = 3
    file[key] = torch.zeros(shape)
    bad = tmp_path / "other.safetensors"
    save_file(file, str(bad), metadata=lora_metadata(out / "lora.safetensors"))
    return bad, key, tuple(shape)


@pytest.mark.parametrize("sets,suffix,axis", UNFIT)
def test_sample_with_a_lora_for_another_model_is_refused(
        tmp_path: Path, images: Path, sets: list[str], suffix: str, axis: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`sample --lora` with a file whose factors do not fit the model's weights: exit 2 naming
    the tensor, its shape and the model's weight shape, and no image."""
    bad, key, shape = _unfit(tmp_path, images, sets, suffix, axis)
    err = sample_refused(tmp_path, images, bad, capsys)
    assert f"--lora {bad}: " in err and "Traceback" not in err, err
    assert f"{key} has shape {shape}" in err and "the model's weight there has shape (" in err
    assert not list(tmp_path.rglob("*.png"))


@pytest.mark.parametrize("sets,suffix,axis", [UNFIT[0], UNFIT[4]])
def test_init_lora_for_another_model_names_the_model_not_the_rank(
        tmp_path: Path, images: Path, sets: list[str], suffix: str, axis: int,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The same check for `--init-lora`, which said "set adapter.rank" for such a file."""
    bad, key, shape = _unfit(tmp_path, images, sets, suffix, axis)
    cfg = run_toml(tmp_path / "run", images, family="flux", fmt=None)
    args = ["train", str(cfg), "--no-progress", "--init-lora", str(bad)]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert f"--init-lora {bad}: " in err and f"{key} has shape {shape}" in err, err
    assert "made for another model" in err and "adapter.rank" not in err, err


def test_a_sample_that_comes_out_nan_is_named_and_not_written(
        good: Path, tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A finite LoRA whose factors overflow the model's activations: the image is NaN. It was
    written as a black PNG; now a warning names the prompt and nothing is written."""
    file = load_file(str(good / "lora.safetensors"))
    huge = {k: torch.full_like(v, 1e30) if "lora_B" in k else v for k, v in file.items()}
    bad = tmp_path / "huge.safetensors"
    save_file(huge, str(bad), metadata=lora_metadata(good / "lora.safetensors"))
    err = sample_refused(tmp_path, images, bad, capsys)  # exit 2: no image written
    assert "'a red circle' (32x32, 1 steps) came out not finite (NaN or inf)" in err, err
    assert "was not written" in err and not list(tmp_path.rglob("*.png"))
