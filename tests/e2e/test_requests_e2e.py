""""Sample now" and "save now" in a real run through the CLI (tiny flavor): requests made
with `difftune request`'s function while step k trains are honoured right after step k (a
sample event, a LoRA file and a checkpoint, as scheduled ones), one made during the last step
by the end of the run; training is the same as without requests, and resumes exactly from
the requested checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.report.metrics import Reporter
from difftune.verbs.request import run_request

from .conftest import metrics_rows, run_toml
from .conftest import train_exit_code as train

# No scheduled sample or save: whatever appears was asked for.
SETS = ["sample.every_n_steps=1000", "sample.at_start=false", "sample.at_end=false"]


def test_requests_sample_and_save_after_the_step_they_arrive_in(
        tmp_path: Path, images: Path, prompts: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = run_toml(tmp_path, images, steps=4, prompts=prompts)
    out = tmp_path / "out"
    asked = {2: ["sample", "save"], 4: ["sample"]}  # 4: the last step
    said: list[str] = []
    real = Reporter.step

    def reporting(self: Reporter, s: int, *args: object, **kwargs: object) -> None:
        real(self, s, *args, **kwargs)  # step s is done; its between-steps work is next
        for kind in asked.get(s, []):
            said.extend(run_request(out, kind))  # type: ignore[arg-type]

    with monkeypatch.context() as mp:
        mp.setattr(Reporter, "step", reporting)
        assert train(cfg, *SETS) == 0
    assert any("the run training there (pid" in line for line in said)
    samples = sorted(p.name for p in (out / "samples").glob("step-*_0*.png"))
    assert [s[:11] for s in samples] == ["step-000002"] * 2 + ["step-000004"] * 2
    assert sorted(p.name for p in out.glob("*.safetensors")) == [
        "lora-step000002.safetensors", "lora.safetensors"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000002", "step-000004"]
    assert not (out / "requests").exists()

    # Requests leave training as it was: a run without any has the same losses.
    rows = [(r["step"], r["loss"]) for r in metrics_rows(out)]
    plain = run_toml(tmp_path / "plain", images, steps=4, prompts=prompts)
    assert train(plain, *SETS) == 0
    assert [(r["step"], r["loss"]) for r in metrics_rows(plain.parent / "out")] == rows
    # Resumed from the requested checkpoint, the run ends exactly as it did.
    final = load_file(str(out / "lora.safetensors"))
    shutil.rmtree(out / "samples")
    assert train(cfg, *SETS, extra=["--resume", str(out / "checkpoints" / "step-000002")]) == 0
    assert [(r["step"], r["loss"]) for r in metrics_rows(out)] == rows  # bitwise
    again = load_file(str(out / "lora.safetensors"))
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)
    assert not (out / "samples").exists()  # the requests were answered once
