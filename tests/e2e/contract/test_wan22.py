"""Wan 2.2 A14B's two experts in one run, through the real CLI on the tiny flavor: one LoRA per
expert (`lora_high_noise`, `lora_low_noise`) that ComfyUI's key map and WanPipeline's loader
(`load_into_transformer_2` for the low-noise file) read as trained, each step's timesteps on
its expert's side of the boundary, the alternation, exact resume with both experts' optimizer
states, samples through both experts, and `check`'s plan and refusals.

One shared run (6 steps, experts alternating every 2: high, high, low, low, high, high) and
its stopped-at-step-3-and-resumed twin serve every test here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from difftune.cli import main
from difftune.families.common.experts import Experts

from ...comfy_keymap import unmapped
from ..conftest import metrics_rows, run_toml, stopped_and_resumed
from .test_wan import RANK

A14B = 'flavor = "tiny"\nvariant = "2.2-t2v-a14b"'
SETS = ("train.expert_switch_every=2", "save.every_n_steps=2", "sample.every_n_steps=100",
        "sample.at_start=false")
STEPS, STOP, ALPHA = 6, 3, 8.0
EXPERTS = {"high": "transformer", "low": "transformer_2"}
BOUNDARY = 875.0  # WanPipeline's boundary_ratio 0.875 x num_train_timesteps 1000


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, images: Path) -> dict:
    """Run `a` through and run `b` stopped after step 3 and resumed, recording the timesteps
    each training forward of the two-expert model was given (a's 6 steps, then b's)."""
    root = tmp_path_factory.mktemp("wan22")
    prompts = root / "prompts.txt"
    prompts.write_text("a red circle --w 16 --h 16 --s 4 --d 7\n", encoding="utf-8")
    cfgs = [run_toml(root / name, images, steps=STEPS, prompts=prompts, fmt=None,
                     family="wan", model=A14B) for name in ("a", "b")]
    rows, seen = recorded_runs(cfgs, STOP, *SETS)
    return {"cfg": cfgs[0], "a": root / "a" / "out", "b": root / "b" / "out", "rows": rows,
            "timesteps": [t for t, _ in seen], "prompts": prompts}


def recorded_runs(cfgs: list[Path], stop: int, *sets: str) -> tuple[tuple, list]:
    """`stopped_and_resumed` over run files `cfgs` (a, b), recording each training forward of
    the two-expert model: ([a's (step, loss) rows, b's], [(its timesteps, its input
    channels), ...] of a's steps, then b's)."""
    seen: list[tuple[torch.Tensor, int]] = []
    real = Experts.forward

    def recording(self: Experts, hidden_states: torch.Tensor, timestep: torch.Tensor,
                  *args: object, **kwargs: object) -> tuple[torch.Tensor]:
        seen.append((timestep.detach().clone(), hidden_states.shape[1]))
        return real(self, hidden_states, timestep, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Experts, "forward", recording)
        rows = stopped_and_resumed(cfgs[0], cfgs[1], mp, stop, *sets)
    return rows, seen


def _turns(steps: range) -> list[str]:
    """The expert of each step with every = 2 (high first)."""
    return ["high" if (s - 1) // 2 % 2 == 0 else "low" for s in steps]


def test_each_step_draws_its_experts_side_of_the_boundary(runs: dict) -> None:
    """Every timestep of a high-noise step is at or above 875 of 1000 (as WanPipeline compares
    it), every one of a low-noise step below, the experts alternating every 2 steps; the
    resumed run goes on in the turn where it stopped (step 4 is still low's)."""
    expected = _turns(range(1, STEPS + 1)) * 2  # run a, then b's 3 steps and its resumed 3
    assert len(runs["timesteps"]) == len(expected)
    for t, expert in zip(runs["timesteps"], expected):
        assert bool((t >= BOUNDARY).all()) if expert == "high" else bool((t < BOUNDARY).all())


def test_stopped_and_resumed_equals_uninterrupted_with_both_experts(runs: dict) -> None:
    """Stopped in low's turn after step 3 and resumed: the same losses and both LoRAs bitwise
    (the turn, its position and both experts' optimizer states restored)."""
    assert runs["rows"][0] == runs["rows"][1]
    for suffix in ("_high_noise", "_low_noise"):
        wa, wb = (load_file(str(runs[r] / f"lora{suffix}.safetensors")) for r in "ab")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_one_lora_per_expert_read_by_comfyui_and_wanpipeline_as_trained(runs: dict) -> None:
    """Final and intermediate saves and checkpoints are pairs; the low-noise file of step 2
    (only high trained so far) is a zero update; every key is in ComfyUI's Wan key map; in a
    WanPipeline, the high file loaded into `transformer` and the low one with
    `load_into_transformer_2` give every module the update the run trained."""
    out = runs["a"]
    assert not (out / "lora.safetensors").exists()
    for stem in ("lora", "lora-step000002", "lora-step000004", "checkpoints/step-000006/lora"):
        for suffix in ("_high_noise", "_low_noise"):
            assert (out / f"{stem}{suffix}.safetensors").is_file()
    early = load_file(str(out / "lora-step000002_low_noise.safetensors"))
    assert all(not v.any() for k, v in early.items() if ".lora_B." in k)
    trained = load_file(str(out / "checkpoints/step-000006/trainable.safetensors"))
    pipe = _pipeline_with_both(out)
    for name, part in EXPERTS.items():
        keys = list(load_file(str(out / f"lora_{name}_noise.safetensors")))
        assert unmapped("wan", keys) == []
        _same_updates(getattr(pipe, part), name, trained, f"transformer.{part}.")


def _pipeline_with_both(out: Path):  # noqa: ANN202 - a WanPipeline
    """The tiny A14B in WanPipeline with the run's pair loaded as users load it."""
    from diffusers import WanPipeline

    from difftune.families.wan.tiny import build_tiny_wan

    pipe = WanPipeline(**build_tiny_wan("2.2-t2v-a14b"))  # boundary_ratio 0.875, as released
    pipe.load_lora_weights(str(out / "lora_high_noise.safetensors"), adapter_name="high")
    pipe.load_lora_weights(str(out / "lora_low_noise.safetensors"), adapter_name="low",
                           load_into_transformer_2=True)
    return pipe


def _same_updates(model: torch.nn.Module, adapter: str, trained: dict[str, torch.Tensor],
                  head: str) -> None:
    """Each module's update B @ A x scale in `model`'s adapter equals the checkpoint's."""
    from peft.utils import get_peft_model_state_dict

    from difftune.adapters.formats import group_modules

    loaded = get_peft_model_state_dict(model, adapter_name=adapter)
    ours = {k.removeprefix(head): v for k, v in trained.items() if k.startswith(head)}
    assert ours and {k.replace(f".{adapter}.", ".") for k in loaded} == set(ours)
    theirs = group_modules(loaded, float(RANK))
    for module, pair in group_modules(ours, ALPHA).items():
        torch.testing.assert_close(theirs[module].delta(), pair.delta(), rtol=1e-5, atol=1e-6)


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def test_samples_run_both_experts_with_both_loras(runs: dict, tmp_path: Path) -> None:
    """The run's final sample is what `difftune sample` makes with both files loaded (each
    into its expert), and it is not the base model's."""
    out, cfg = runs["a"], runs["cfg"]
    after = _pixels(next((out / "samples").glob(f"step-{STEPS:06d}_00_*.png")))
    written = tmp_path / "both"
    assert main(["sample", str(cfg), "--lora", str(out / "lora_high_noise.safetensors"),
                 "--lora", str(out / "lora_low_noise.safetensors"), "--out", str(written)]) == 0
    assert np.array_equal(_pixels(next(written.glob("*_00_*.png"))), after)
    base = tmp_path / "base"
    assert main(["sample", str(cfg), "--out", str(base)]) == 0
    assert np.abs(_pixels(next(base.glob("*_00_*.png"))) - after).max() >= 2


@pytest.mark.full_only
@pytest.mark.parametrize("expert", ["high", "low"])
def test_a_sample_with_one_expert_lora_differs(runs: dict, tmp_path: Path, expert: str) -> None:
    """Each file alone samples otherwise than the pair: both experts run in a sample."""
    out = runs["a"]
    after = _pixels(next((out / "samples").glob(f"step-{STEPS:06d}_00_*.png")))
    assert main(["sample", str(runs["cfg"]), "--lora",
                 str(out / f"lora_{expert}_noise.safetensors"), "--out", str(tmp_path)]) == 0
    assert np.abs(_pixels(next(tmp_path.glob("*_00_*.png"))) - after).max() >= 2


def test_check_reports_the_plan_and_refuses_bad_expert_settings(
        images: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`check` names each expert's timestep range, its file, the alternation and the idle
    expert's host memory; bad settings exit 2 naming the option, before anything loads."""
    cfg = run_toml(tmp_path, images, family="wan", model=A14B, fmt=None)
    assert main(["check", str(cfg), "--set", "train.expert_switch_every=3"]) == 0
    report = capsys.readouterr().out
    assert "expert high (transformer): timesteps t >= 0.875" in report
    assert "expert low (transformer_2): timesteps t < 0.875" in report
    assert "alternation: high -> low, 3 step(s) each" in report
    assert "idle one waits in host memory" in report
    bad = {"train.expert_switch_every=0": "train.expert_switch_every",
           'train.experts=["mid"]': "'mid' is no expert",
           "train.expert_boundary=1.5": "train.expert_boundary",
           "train.blocks_to_swap=1": "train.blocks_to_swap with 2.2-t2v-a14b",
           'adapter.type="lokr"': 'adapter.type = "lokr" with 2.2-t2v-a14b',
           'model.variant="2.1-t2v-14b"': "train.experts"}
    for setting, named in bad.items():
        sets = ["--set", setting]
        if setting.startswith("model."):
            sets += ["--set", 'train.experts=["high"]']
        assert main(["check", str(cfg), *sets]) == 2
        err = capsys.readouterr().err
        assert named in err and "Traceback" not in err, (setting, err)


def test_init_lora_reads_a_pair_each_file_into_its_expert(runs: dict, images: Path,
                                                          tmp_path: Path) -> None:
    """`--init-lora <name>_high_noise.safetensors` starts each expert from its file of the pair
    (the low-noise twin found beside it): one step at a negligible lr writes them back."""
    out = runs["a"]
    cfg = run_toml(tmp_path, images, steps=1, fmt=None, family="wan", model=A14B)
    assert main(["train", str(cfg), "--no-progress", "--set", "train.lr=1e-12", "--init-lora",
                 str(out / "lora_high_noise.safetensors")]) == 0
    for suffix in ("_high_noise", "_low_noise"):
        start, again = (load_file(str(d / f"lora{suffix}.safetensors"))
                        for d in (out, tmp_path / "out"))
        assert start.keys() == again.keys()
        for key in start:
            torch.testing.assert_close(again[key], start[key], rtol=1e-5, atol=1e-7)


def test_runs_rank_and_the_web_app_find_the_pairs(runs: dict, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`difftune runs rank` lists each saved step by its pair, both files (the high-noise file
    first), in its table and its JSON, and the web app's summary finds the final pair."""
    import json
    import shutil

    from difftune.ui.runs import summary
    from difftune.verbs.rank import checkpoints

    out = runs["a"]
    cfg = json.loads((out / "config.resolved.json").read_text(encoding="utf-8"))
    found = checkpoints(out, cfg, metrics_rows(out))
    assert {s: [p.name for p in ps] for s, ps in found.items()} == {
        s: [f"{stem}_high_noise.safetensors", f"{stem}_low_noise.safetensors"]
        for s, stem in ((2, "lora-step000002"), (4, "lora-step000004"), (6, "lora"))}
    assert summary(out).lora == str(out / "lora_high_noise.safetensors")
    bare = tmp_path / "run"  # without its samples, which rank would measure
    shutil.copytree(out, bare, ignore=shutil.ignore_patterns("samples"))
    assert main(["runs", "rank", str(bare), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    final = [str(bare / f"lora_{e}_noise.safetensors") for e in ("high", "low")]
    assert [e["files"] for e in listed if e["step"] == 6] == [final]
    assert [e["file"] for e in listed if e["step"] == 6] == final[:1]
    assert main(["runs", "rank", str(bare)]) == 0
    assert ("lora-step000004_high_noise.safetensors + lora-step000004_low_noise.safetensors"
            in capsys.readouterr().out)
