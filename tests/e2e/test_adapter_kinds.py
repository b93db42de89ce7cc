"""LoCon, LoHa, LoKr and DoRA runs through the real CLI: exact resume, `--init-lora` from their
files, `check`'s report, and the refusals at config load. (Their files are checked against
the LyCORIS library in test_lycoris_files.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.config import load_config
from difftune.errors import CheckpointError, ConfigError
from difftune.train.checkpoint import CheckpointManager
from difftune.train.init_lora import load_init_lora
from difftune.train.setup import prepare

from .conftest import assert_same_lora, lora_metadata, run_toml, stopped_and_resumed

FULL = pytest.mark.full_only
# Default: the two LyCORIS products on FLUX.1 (LoKr with its text-encoder adapter) and DoRA
# LoCon with Conv2d layers on SDXL; the other kinds with --full.
KINDS = [
    ("flux", ["adapter.type=lokr", "adapter.rank=2", 'adapter.text_encoders=["clip_l"]']),
    ("sdxl", ["adapter.type=locon", "adapter.dora=true", "adapter.conv_rank=2"]),
    pytest.param("flux", ["adapter.type=loha"], marks=FULL),
    pytest.param("flux", ["adapter.type=lokr", "adapter.full_matrix=true"], marks=FULL),
    pytest.param("flux", ["adapter.dora=true"], marks=FULL),
    pytest.param("sdxl", ["adapter.type=lokr", "adapter.rank=1", "adapter.decompose_both=true",
                          "adapter.conv_rank=2"], marks=FULL),
]


def manager(cfg: Path, *sets: str) -> CheckpointManager:
    """A prepared run's checkpoint manager (its adapter freshly initialized)."""
    config = load_config(cfg, list(sets))
    run = prepare(config, show_progress=False)
    return CheckpointManager(config, run.family, run.comps, run.targets, {})


@pytest.mark.parametrize("family,sets", KINDS)
def test_resume_is_exact_and_init_lora_continues_from_the_file(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch, family: str,
        sets: list[str]) -> None:
    a, b = (run_toml(tmp_path / n, images, steps=3, fmt=None, family=family) for n in "ab")
    full, resumed = stopped_and_resumed(a, b, monkeypatch, 2, *sets)
    assert full == resumed
    assert_same_lora(a.parent / "out", b.parent / "out")
    saved = a.parent / "out" / "lora.safetensors"
    kind = sets[0].split("=")[1] if sets[0].startswith("adapter.type") else "lora"
    assert lora_metadata(saved)["difftune.adapter"] == kind
    # A new run from the file starts from exactly the trained adapter.
    trained = load_file(str(sorted((a.parent / "out" / "checkpoints").glob("step-*"))[-1]
                             / "trainable.safetensors"))
    m = manager(run_toml(tmp_path / "c", images, fmt=None, family=family), *sets)
    load_init_lora(saved, m)
    got = m.trainable()
    assert got.keys() == trained.keys()
    for key, value in trained.items():
        torch.testing.assert_close(got[key].detach(), value, rtol=1e-6, atol=0, msg=key)


def test_a_file_of_another_kind_is_refused(tmp_path: Path, images: Path) -> None:
    src = manager(run_toml(tmp_path / "src", images, fmt=None), "adapter.type=lokr", "adapter.rank=2")
    path = src.save_lora(1, final=True)
    m = manager(run_toml(tmp_path / "new", images, fmt=None), "adapter.type=loha")
    with pytest.raises(CheckpointError, match=r"holds a LoKr adapter.*trains a LoHa.*"
                                              r"adapter.type = \"lokr\""):
        load_init_lora(path, m)
    plain = manager(run_toml(tmp_path / "plain", images))
    with pytest.raises(CheckpointError, match="holds a LoKr adapter"):
        load_init_lora(path, plain)


@pytest.mark.parametrize("sets,message", [
    (["adapter.type=lokr", "adapter.dora=true"], r"adapter.dora works with adapter.type"),
    (["adapter.type=loha", "adapter.conv_rank=4"], r"adapter.conv_rank: model.family = \"flux\" "
                                                   r"has no Conv2d layers"),
    (["adapter.factor=4"], r"adapter.factor is a LoKr option"),
    (["adapter.type=lokr", "adapter.full_matrix=true", "adapter.decompose_both=true"],
     r"full_matrix.*decompose_both"),
    (["adapter.type=loha", "save.format=kohya"], r"save.format = \"kohya\" chooses a plain"),
    (["adapter.type=lokr", "adapter.dropout=0.1"], r"adapter.dropout is LoRA's input dropout"),
])
def test_kind_options_that_cannot_work_are_refused_at_load(
        tmp_path: Path, images: Path, sets: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(run_toml(tmp_path, images, fmt=None), sets)


def test_check_states_the_kind_and_its_parameter_count(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, fmt=None)
    assert main(["check", str(cfg), "--set", "adapter.type=lokr", "--set",
                 "adapter.rank=2"]) == 0
    out = capsys.readouterr().out
    m = manager(cfg, "adapter.type=lokr", "adapter.rank=2")
    count = sum(p.numel() for p in m.trainable().values())
    assert "adapter: LoKr, rank 2, on " in out
    assert f"{count / 1e3:.2f} K trainable parameters" in out or f"{count} trainable" in out
    assert "adapter file format: LyCORIS (lycoris_<module>" in out


# The precision set-ups for the LyCORIS kinds: fp16/bf16 mixed on a half-precision base, fp8
# storage, and quantized (torchao int8, quanto qint8) bases: with --full (the default tier's
# precision matrix runs these modes for LoRA).
PRECISION = [
    pytest.param("flux", "lokr", "bf16", "int8", marks=FULL),
    pytest.param("flux", "lokr", "fp16", "half", marks=FULL),
    pytest.param("flux", "lokr", "bf16", "fp8", marks=FULL),
    pytest.param("sdxl", "loha", "bf16", "int8", marks=FULL),
    pytest.param("sdxl", "locon", "fp16", "fp8", marks=FULL),
    pytest.param("flux", "lora", "bf16", "int8", marks=FULL),  # DoRA on a quantized base
    pytest.param("flux", "lokr", "bf16", "qint8", marks=FULL),  # optimum-quanto
    pytest.param("sdxl", "loha", "bf16", "qint8", marks=FULL),
]
QUANTO = {"quantize": {"denoiser": "qint8", "text_encoders": "qint8"}}


@pytest.mark.parametrize("family,kind,mixed,base", PRECISION)
def test_lycoris_kinds_train_in_every_precision_mode(tmp_path: Path, images: Path, family: str,
                                                     kind: str, mixed: str, base: str) -> None:
    from .test_precision_matrix import BASES

    if base == "qint8":
        pytest.importorskip("optimum.quanto")
    bases = BASES | {"qint8": QUANTO}
    parts = ("denoiser", "text_encoders", "vae")
    precision = {"mixed": mixed, **bases[base],
                 **({p: mixed for p in parts} if base == "half" else {})}
    extra = "\n[precision]\n" + "".join(
        f"{k} = {_toml(v)}\n" for k, v in precision.items() if not isinstance(v, dict))
    for table, values in ((k, v) for k, v in precision.items() if isinstance(v, dict)):
        extra += f"[precision.{table}]\n" + "".join(f"{k} = {_toml(v)}\n"
                                                   for k, v in values.items())
    sets = [f"adapter.type={kind}", "adapter.rank=2", "train.steps=1"]
    sets += ["adapter.dora=true"] if kind == "lora" else []
    sets += ["adapter.conv_rank=2"] if family == "sdxl" else []
    cfg = run_toml(tmp_path, images, fmt=None, family=family, extra=extra)
    assert main(["train", str(cfg), "--no-progress"] + [a for s in sets
                                                        for a in ("--set", s)]) == 0
    out = tmp_path / "out"
    saved = load_file(str(out / "lora.safetensors"))
    trained = load_file(str(sorted((out / "checkpoints").glob("step-*"))[-1]
                            / "trainable.safetensors"))
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in trained.values())
    # Only adapter tensors reach the file (no quantizer or fp8 names leak), and a new run
    # started from it holds the trained weights.
    suffixes = {k.partition(".")[2] for k in saved}
    assert suffixes and all(s == "alpha" or s.startswith(("lokr_", "hada_", "lora_", "dora"))
                            for s in suffixes), suffixes
    m = manager(cfg, *sets)
    load_init_lora(out / "lora.safetensors", m)
    got = m.trainable()
    for key, value in trained.items():
        torch.testing.assert_close(got[key].detach(), value, rtol=1e-6, atol=0, msg=key)


def _toml(value: object) -> str:
    """A TOML scalar."""
    return f'"{value}"' if isinstance(value, str) else str(value).lower()


@pytest.mark.parametrize("family,sets", [
    ("flux", ["adapter.type=lokr", "adapter.rank=2", 'adapter.text_encoders=["clip_l"]']),
    pytest.param("sdxl", ["adapter.type=loha", "adapter.conv_rank=2"], marks=FULL),
])
def test_sample_verb_applies_a_lycoris_file_as_trained(tmp_path: Path, images: Path,
                                                       family: str, sets: list[str]) -> None:
    """`difftune sample --lora` draws with a LoKr/LoHa file (applied through the LyCORIS
    library; diffusers reads neither) what the run drew with its own adapter at its end."""
    import numpy as np
    from PIL import Image

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 5\n", encoding="utf-8")
    cfg = run_toml(tmp_path, images, steps=2, fmt=None, family=family, prompts=prompts)
    args = ["train", str(cfg), "--no-progress", "--set", "sample.at_start=false"]
    assert main(args + [a for s in sets for a in ("--set", s)]) == 0
    out = tmp_path / "out"

    def image(folder: Path, pattern: str) -> np.ndarray:
        found = sorted(folder.glob(pattern))
        assert len(found) == 1, found
        return np.asarray(Image.open(found[0]), dtype=np.int16)

    trained = image(out / "samples", "step-000002_00_*.png")
    for name, extra in (("with", ["--lora", str(out / "lora.safetensors")]), ("base", [])):
        assert main(["sample", str(cfg), "--prompts", str(prompts), "--out",
                     str(tmp_path / name)] + extra) == 0
    sampled, base = image(tmp_path / "with", "sample-*_00_*.png"), image(tmp_path / "base",
                                                                         "sample-*_00_*.png")
    assert np.abs(base - trained).max() > 4  # the adapter shows
    assert np.abs(sampled - trained).max() <= 1  # float rounding of another implementation


@FULL
def test_two_processes_train_a_lokr_as_one_does(tmp_path: Path, images: Path) -> None:
    """LoKr (with a text encoder) under accelerate's two gloo processes of batch 1 matches
    one process of batch 2, as LoRA does (tests/e2e/test_distributed.py)."""
    from .test_distributed import assert_close_runs, launch

    sets = ["adapter.type=lokr", "adapter.rank=2", 'adapter.text_encoders=["clip_l"]']
    two = run_toml(tmp_path / "two", images, steps=3, fmt=None)
    done = launch(["-m", "difftune", "train", str(two), "--no-progress", "--set",
                   "train.batch_size=1"] + [a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    one = run_toml(tmp_path / "one", images, steps=3, fmt=None)
    assert main(["train", str(one), "--no-progress"] + [a for s in sets
                                                        for a in ("--set", s)]) == 0
    assert_close_runs(tmp_path / "two" / "out", tmp_path / "one" / "out")
