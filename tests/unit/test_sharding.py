"""FSDP pieces that need no process group: config refusals, the refusal of sampling in a
sharded multi-process run, and sharded checkpoint files written and read in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune import families
from difftune.cli import main
from difftune.config import load_config
from difftune.errors import ConfigError
from difftune.memory import savers
from difftune.train import sharding
from tests.unit.test_config import GOOD, write

FSDP = GOOD.replace("steps = 10", 'steps = 10\ndistributed = "fsdp"')
FULL = FSDP + '\n[adapter]\ntype = "full"\n'


@pytest.mark.parametrize("text, sets, field", [
    (FSDP, [], 'adapter.type = "lora" trains a few MB'),
    (FULL, ["train.blocks_to_swap=1"], "train.blocks_to_swap with train.distributed"),
    (FULL, ["train.fused_backward=true"], "train.fused_backward with train.distributed"),
    (FULL, ["train.ema.enabled=true", "train.ema.cpu=true"], "train.ema.cpu with train."),
    (FULL, ['adapter.text_encoders=["t5"]'], "trained text encoders or embeddings"),
    (FULL, ['precision.mixed="fp16"'], 'precision.mixed = "fp16" with train.distributed'),
    # Run sharded on two processes, both failed in their factored moments (DTensor mixing).
    (FULL, ['train.optimizer="adafactor"'], 'train.optimizer = "adafactor" with train.distrib'),
    (FULL, ['train.optimizer="came"'], 'train.optimizer = "came" with train.distributed'),
])
def test_fsdp_refusals_at_load(tmp_path: Path, text: str, sets: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), sets)
    assert field in str(err.value)


def test_fsdp_with_lora_is_refused_by_the_cli(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(write(tmp_path, FSDP))]) == 2
    assert "train.distributed = \"ddp\"" in capsys.readouterr().err
    assert load_config(write(tmp_path, FULL)).train.distributed == "fsdp"


def test_sampling_in_a_sharded_multi_process_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("a cat\n")
    cfg = load_config(write(tmp_path, FULL + '[sample]\nprompts = "p.txt"\nevery_n_steps = 5\n'))
    family = families.get("flux")
    savers.check(cfg, family, torch.device("cpu"), 1)  # one process: nothing is sharded
    with pytest.raises(ConfigError, match="sampling during a sharded run"):
        savers.check(cfg, family, torch.device("cpu"), 2)
    assert savers.denoiser_home(cfg, 2) == torch.device("cpu")  # FSDP places the shards


def test_sharded_files_read_back_on_one_process(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).square().sum().backward()
    opt.step()
    params = {f"m.{n}": p for n, p in model.named_parameters()}
    state = {f"m.{n}::{k}": v for n, p in model.named_parameters()
             for k, v in opt.state[p].items()}
    ema = {"m.weight": params["m.weight"].detach() * 0.5}
    sharding.save(tmp_path / "s", params, state, ema)
    assert all(p.suffix == ".safetensors" for p in (tmp_path / "s").iterdir())  # no pickle
    weights, moments, averaged = sharding.shapes(tmp_path / "s")
    assert {k: tuple(v.shape) for k, v in weights.items()} == {"m.weight": (3, 4), "m.bias": (3,)}
    assert moments["m.weight::step"].shape == () and moments.keys() == state.keys()
    assert averaged.keys() == ema.keys()
    fresh = torch.nn.Linear(4, 3)
    into = {f"m.{n}": p for n, p in fresh.named_parameters()}
    loaded, loaded_ema = sharding.load(tmp_path / "s", into, moments, averaged)
    assert all(torch.equal(into[k], params[k]) for k in params)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert torch.equal(loaded_ema["m.weight"], ema["m.weight"])
