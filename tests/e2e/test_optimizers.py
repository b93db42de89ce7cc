"""Every CPU optimizer through the real CLI on the cheapest tiny family (SD3): a run stopped
by a signal and resumed equals the uninterrupted one bit for bit (its state saved by parameter
name in the checkpoint), the memory estimate equals the state it really saved, schedule-free's
LoRA files hold its evaluation weights (x), not the training point (y), and `check` reports the
optimizer's memory estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli import main
from difftune.train.optimizers.specs import parse_args, state_bytes

from .conftest import assert_same_lora, run_toml, stopped_and_resumed, train_exit_code

FAMILY = "sd3"
CASES = [
    pytest.param("schedulefree_adamw", ["train.warmup_steps=2", "adapter.alpha=4"],
                 id="schedulefree"),
    pytest.param("prodigy", ['train.scheduler="cosine"', "train.warmup_steps=1", "train.lr=1.0",
                             "train.optimizer_args.safeguard_warmup=true"], id="prodigy"),
    pytest.param("adafactor", ["train.optimizer_args.relative_step=true"],
                 id="adafactor-relative"),
    pytest.param("adafactor", ['train.scheduler="linear"', "train.optimizer_args.beta1=0.9"],
                 id="adafactor", marks=pytest.mark.full_only),
    pytest.param("came", ["train.lr=1e-3"], id="came", marks=pytest.mark.full_only),
    pytest.param("lion", ["train.lr=1e-3", "train.weight_decay=0.1"], id="lion",
                 marks=pytest.mark.full_only),
    pytest.param("adamw", ['train.scheduler="cosine"'], id="adamw", marks=pytest.mark.full_only),
]


def _run_file(folder: Path, images: Path, prompts: Path, sets: list[str]) -> Path:
    """A 6-step SD3 run (schedule-free: sampling every 2 steps, from its evaluation weights);
    without train.lr for a relative-step run (which refuses an lr it would not read)."""
    sample = prompts if 'train.optimizer="schedulefree_adamw"' in sets else None
    cfg = run_toml(folder, images, steps=6, family=FAMILY, prompts=sample)
    if "train.optimizer_args.relative_step=true" in sets:
        cfg.write_text(cfg.read_text(encoding="utf-8").replace("lr = 1e-2\n", ""),
                       encoding="utf-8")
    return cfg


@pytest.mark.parametrize(("optimizer", "sets"), CASES)
def test_resumed_run_equals_uninterrupted(tmp_path: Path, images: Path, prompts: Path,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str], optimizer: str,
                                          sets: list[str]) -> None:
    sets = [f'train.optimizer="{optimizer}"', "save.every_n_steps=2", *sets]
    a, b = (_run_file(tmp_path / x, images, prompts, sets) for x in "ab")
    rows_a, rows_b = stopped_and_resumed(a, b, monkeypatch, 3, *sets)
    assert rows_a == rows_b and len(rows_a) == 6  # bitwise losses
    assert_same_lora(a.parent / "out", b.parent / "out")
    last = a.parent / "out" / "checkpoints" / "step-000006"
    trained = load_file(str(last / "trainable.safetensors"))
    state = load_file(str(last / "optimizer.safetensors"))
    doc = json.loads((last / "state.json").read_text(encoding="utf-8"))
    args = {k.split(".")[-1]: json.loads(v) for k, v in (s.split("=") for s in sets)
            if k.startswith("train.optimizer_args.")}
    real = sum(v.numel() * v.element_size() for v in state.values() if v.dim() > 0)
    estimate = state_bytes(optimizer, parse_args(optimizer, args),
                           [tuple(v.shape) for v in trained.values()])
    # Prodigy keeps a scalar p0 for a weight that is zero at its first step (LoRA up matrices).
    assert real <= estimate if optimizer == "prodigy" else real == estimate
    if optimizer == "schedulefree_adamw":
        _assert_lora_holds_eval_weights(a.parent / "out", trained, state, doc)
    if optimizer == "prodigy":  # another optimizer cannot continue this one's state
        capsys.readouterr()
        other = ['train.optimizer="lion"', "train.steps=8"]
        assert train_exit_code(a, *other, extra=["--resume", "latest"]) == 2
        assert "its optimizer state is prodigy's" in capsys.readouterr().err


def _assert_lora_holds_eval_weights(out: Path, y: dict[str, torch.Tensor],
                                    state: dict[str, torch.Tensor], doc: dict) -> None:
    """The final LoRA (alpha = rank: nothing folded in) is schedule-free's x, computed here
    from the checkpoint's training point y and its z the way the library's eval() does."""
    beta1 = doc["optimizer"][0]["betas"][0]
    lora = load_file(str(out / "lora.safetensors"))
    assert lora.keys() == y.keys()
    for name, value in y.items():
        x = value.lerp(state[f"{name}::z"], 1 - 1 / beta1)
        assert torch.equal(lora[name], x), name
    assert any(not torch.equal(lora[n], y[n]) for n in y)


def test_check_reports_the_optimizer_memory_and_refuses_bad_options(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family=FAMILY)
    assert main(["check", str(cfg), "--set", 'train.optimizer="came"']) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "optimizer:" in x)
    assert "came (came-pytorch); state about" in line and "the lr schedule applies" in line
    bad = [(['train.optimizer="prodigy"', "train.optimizer_args.dcoef=1"],
            'prodigy has no option "dcoef"; its options: d_coef'),
           (['train.optimizer="prodigy"', "adapter.text_encoder_lr=1e-4"],
            "prodigy runs every parameter group at one lr"),
           (['train.optimizer="adafactor"', "train.optimizer_args.relative_step=true",
             "adapter.embedding_lr=1e-3"], "never reads a learning rate"),
           (['train.optimizer="lion8bit"'], 'use optimizer = "lion" on the CPU')]
    no_lr = tmp_path / "no_lr" / "run.toml"  # a relative-step run leaves train.lr out
    no_lr.parent.mkdir()
    no_lr.write_text(cfg.read_text(encoding="utf-8").replace("lr = 1e-2\n", ""),
                     encoding="utf-8")
    for sets, message in bad:
        path = no_lr if "train.optimizer_args.relative_step=true" in sets else cfg
        assert main(["check", str(path), *[a for s in sets for a in ("--set", s)]]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
