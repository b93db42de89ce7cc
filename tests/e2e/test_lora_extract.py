"""`difftune lora extract`: a known low-rank difference between two models of a family is
recovered exactly, in a spelling ComfyUI applies in full, and merging it back gives the tuned
model (single files of every family's tiny flavor)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main
from difftune.families import registry
from difftune.files.single import write_layout
from difftune.lora_tools.extract import extract
from difftune.lora_tools.merge_base import merge_into_base
from difftune.lora_tools.names import tiny_components
from difftune.lora_tools.programs import comfyui
from difftune.lora_tools.verify import verify_file

from ..comfy_keymap import MAPS

FAST = ("flux", "qwen_image")


def tuned_pair(tmp_path: Path, family: str) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """(base, tuned) single files of the tiny model, tuned = base + a rank-2 update on every
    third weight matrix, and those updates by file key."""
    comps = tiny_components(family)
    layout = registry.get(family).single_file_layout(comps)
    base = write_layout(tmp_path / "base.safetensors", layout, comps.denoiser.state_dict(),
                        torch.float32)
    tensors = load_file(str(base))
    gen = torch.Generator().manual_seed(3)
    changed = {}
    for key in [k for k, v in tensors.items() if v.ndim == 2 and k.endswith(".weight")][::3]:
        rows, cols = tensors[key].shape
        changed[key] = torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)
        tensors[key] = tensors[key] + changed[key]
    tuned = tmp_path / "tuned.safetensors"
    save_file(tensors, str(tuned))
    return base, tuned, changed


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST else
                                                 pytest.mark.full_only)
                                    for f in registry.names() if MAPS[f].weights])
# (a family ComfyUI has no model for, FLUX.3, extracts from diffusers-named files instead:
# tests/unit/test_flux3_files.py)
def test_extract_recovers_a_low_rank_difference(tmp_path: Path, family: str) -> None:
    base, tuned, changed = tuned_pair(tmp_path, family)
    report = extract(base, tuned, rank=2, out=tmp_path / "lora.safetensors")
    assert report.family == family and len(report.modules) == len(changed)
    assert all(k == pytest.approx(1.0) for k in report.modules.values())
    comfy = verify_file(report.path, family).results[0]
    if comfyui(family).absent:  # ComfyUI loads no model of the family: nothing applies
        assert comfy.applied == 0 and comfy.dropped
    else:
        assert comfy.dropped == [] and comfy.applied > 0
    back = load_file(merge_into_base(base, [(Path(report.path), 1.0)],
                                     tmp_path / "back.safetensors").path)
    want = load_file(str(tuned))
    for key in want:
        torch.testing.assert_close(back[key], want[key], rtol=1e-4, atol=1e-4, msg=key)


def test_extract_cli_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base, tuned, _ = tuned_pair(tmp_path, "z_image")
    assert main(["lora", "extract", "--base", str(base), "--tuned", str(tuned), "--rank",
                 "1"]) == 0
    out = capsys.readouterr().out
    assert "tuned-lora-r1.safetensors" in out and "z_image" in out
    assert main(["lora", "extract", "--base", str(base), "--tuned", str(base), "--rank", "1",
                 "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "no weight matrix that differs" in capsys.readouterr().err
    assert main(["lora", "extract", "--base", str(base), "--tuned", str(tuned), "--rank",
                 "1"]) == 2  # the default output exists now
    assert "--overwrite" in capsys.readouterr().err
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"not a safetensors file")
    assert main(["lora", "extract", "--base", str(broken), "--tuned", str(tuned), "--rank",
                 "1", "--out", str(tmp_path / "y.safetensors")]) == 2
    assert "--base" in capsys.readouterr().err
