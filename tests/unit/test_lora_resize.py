"""`difftune lora resize`: exact at full rank, the best cut and its stated energy below it,
for LoRA, LoCon and DoRA modules in kohya's and PEFT's spellings; refusals without a trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from difftune.cli import main

GEN = torch.Generator().manual_seed(0)


def rand(*shape: int) -> torch.Tensor:
    """A seeded random tensor."""
    return torch.randn(*shape, generator=GEN)


def delta(parts: dict[str, torch.Tensor], down: str, up: str) -> torch.Tensor:
    """scale * up @ down of one module (flattened), scale from its alpha (1 without)."""
    d, u = parts[down].double().flatten(1), parts[up].double().flatten(1)
    scale = float(parts["alpha"]) / d.shape[0] if "alpha" in parts else 1.0
    return scale * u @ d


def modules(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {tensor name: tensor}} (split at the first dot after the module stem)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        stem, _, name = key.partition(".")
        out.setdefault(stem, {})[name] = value
    return out


@pytest.fixture
def kohya_file(tmp_path: Path) -> Path:
    """A kohya-style file: a rank-6 linear LoRA, a rank-4 LoCon and a rank-5 DoRA module."""
    tensors = {"lora_unet_a.lora_down.weight": rand(6, 20), "lora_unet_a.lora_up.weight":
               rand(16, 6), "lora_unet_a.alpha": torch.tensor(3.0),
               "lora_unet_conv.lora_down.weight": rand(4, 8, 3, 3),
               "lora_unet_conv.lora_up.weight": rand(12, 4, 1, 1),
               "lora_unet_conv.alpha": torch.tensor(8.0),
               "lora_unet_d.lora_down.weight": rand(5, 10), "lora_unet_d.lora_up.weight":
               rand(10, 5), "lora_unet_d.dora_scale": rand(10, 1)}
    path = tmp_path / "k.safetensors"
    save_file(tensors, str(path), metadata={"ss_network_dim": "6", "ss_network_alpha": "3.0"})
    return path


def test_full_rank_is_exact_and_states_the_new_alpha(kohya_file: Path) -> None:
    out = kohya_file.with_name("full.safetensors")
    assert main(["lora", "resize", str(kohya_file), "--rank", "64", "--out", str(out)]) == 0
    old, new = modules(load_file(str(kohya_file))), modules(load_file(str(out)))
    for name in old:
        torch.testing.assert_close(delta(new[name], "lora_down.weight", "lora_up.weight"),
                                   delta(old[name], "lora_down.weight", "lora_up.weight"),
                                   rtol=1e-5, atol=1e-5)
    assert float(new["lora_unet_a"]["alpha"]) == 6.0
    assert new["lora_unet_conv"]["lora_down.weight"].shape == (4, 8, 3, 3)
    assert torch.equal(new["lora_unet_d"]["dora_scale"], old["lora_unet_d"]["dora_scale"])


def test_lower_rank_is_the_best_cut_with_the_stated_energy(kohya_file: Path) -> None:
    from difftune.lora_tools.resize import resize_file

    report = resize_file(kohya_file, rank=2)
    new = modules(load_file(report.path))
    old = modules(load_file(str(kohya_file)))
    for name, (was, now, kept) in report.modules.items():
        assert (now, new[name]["lora_down.weight"].shape[0]) == (2, 2)
        full = delta(old[name], "lora_down.weight", "lora_up.weight")
        u, s, vh = torch.linalg.svd(full, full_matrices=False)
        best = (u[:, :2] * s[:2]) @ vh[:2]
        cut = delta(new[name], "lora_down.weight", "lora_up.weight")
        torch.testing.assert_close(cut, best, rtol=1e-5, atol=1e-5)
        assert kept == pytest.approx(float(cut.norm() ** 2 / full.norm() ** 2), rel=1e-6)
    assert load_file(report.path) and Path(report.path).name == "k-r2.safetensors"


def test_energy_keeps_the_fewest_values_holding_the_share(tmp_path: Path) -> None:
    from difftune.lora_tools.resize import resize_file

    tensors = {"transformer.x.lora_A.weight": rand(8, 30),
               "transformer.x.lora_B.weight": rand(30, 8)}
    path = tmp_path / "p.safetensors"
    save_file(tensors, str(path), metadata={"lora_adapter_metadata": "{}"})
    report = resize_file(path, energy=0.9)
    (_, rank, kept), = report.modules.values()
    s = torch.linalg.svdvals(tensors["transformer.x.lora_B.weight"].double()
                             @ tensors["transformer.x.lora_A.weight"].double())
    shares = torch.cumsum(s**2, 0) / (s**2).sum()
    assert kept >= 0.9 > float(shares[rank - 2]) and kept == pytest.approx(float(shares[rank - 1]))
    with safe_open(report.path, "pt") as f:
        meta = f.metadata()
    assert "lora_adapter_metadata" not in meta and meta["ss_network_dim"] == str(rank)


def test_refusals(tmp_path: Path, kohya_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lokr = tmp_path / "lokr.safetensors"
    save_file({"lycoris_x.lokr_w1": rand(2, 2), "lycoris_x.lokr_w2": rand(4, 4)}, str(lokr))
    assert main(["lora", "resize", str(lokr), "--rank", "2"]) == 2
    assert "lycoris_x is a LoKr" in capsys.readouterr().err
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"mine")
    assert main(["lora", "resize", str(kohya_file), "--rank", "2", "--out", str(taken)]) == 2
    assert "--overwrite" in capsys.readouterr().err and taken.read_bytes() == b"mine"
    assert main(["lora", "resize", str(kohya_file), "--energy", "1.5"]) == 2
    assert not kohya_file.with_name("k-e1.5.safetensors").exists()
