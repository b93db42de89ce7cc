"""`difftune lora inspect`: family, kind, layout, trainer, ranks, metadata and NaN of LoRA
files written the way each trainer writes them (`tests/lora_files.py`), through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safetensors.torch import save_file

from difftune.adapters.formats import save_lora
from difftune.cli import main
from difftune.families import registry
from difftune.lora_tools.inspect import inspect_file

from ..lora_files import TRAINERS, diffusers_lora, linear_modules, spelled

TRAINER_NAMES = {"diffusers": "diffusers / PEFT", "ai-toolkit": "ai-toolkit",
                 "onetrainer": "OneTrainer", "simpletuner-lycoris": "SimpleTuner (LyCORIS)",
                 "musubi": "kohya sd-scripts or musubi-tuner"}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`difftune lora ...` through the CLI's entry point: (exit status, stdout, stderr)."""
    status = main(["lora", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.parametrize("family", list(registry.names()))
def test_each_familys_file_is_recognised(tmp_path: Path, family: str) -> None:
    state = diffusers_lora(family, linear_modules(family))
    path = save_lora(tmp_path / "a.safetensors", state, {})
    report = inspect_file(path)
    assert report.family == family  # names shared with another family: the smaller one
    assert family not in report.also_fits
    assert report.kinds == {"LoRA": len(state) // 2}
    assert report.unresolved == [] and report.non_finite == {}


def test_trainers_are_named_from_their_key_spelling(tmp_path: Path) -> None:
    state = diffusers_lora("z_image", linear_modules("z_image", r"attention\.to_q$"))
    for trainer, spell in TRAINERS.items():
        path = save_lora(tmp_path / f"{trainer}.safetensors", spell(state, "transformer"), {})
        report = inspect_file(path)
        assert report.family == "z_image", trainer
        assert report.trainer.startswith(TRAINER_NAMES[trainer]), trainer
        assert sum(report.layouts.values()) == len(state) // 2


def test_kohya_file_ranks_alphas_metadata_blocks_and_nan(tmp_path: Path) -> None:
    fam = registry.get("flux")
    from ..lora_files import tiny

    state = diffusers_lora("flux", linear_modules("flux", r"attn\.to_[qkv]$|^proj_out"))
    tensors = fam.lora_to_format(tiny("flux"), state, "kohya", 4, 2.0)
    tensors["lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight"][0, 0] = float("nan")
    meta = {"ss_network_module": "networks.lora_flux", "ss_base_model_version": "flux1",
            "modelspec.title": "mine", "unrelated": "x"}
    path = tmp_path / "k.safetensors"
    save_file(tensors, str(path), metadata=meta)  # as kohya writes it, NaN and all
    report = inspect_file(path)
    assert report.family == "flux" and report.also_fits == []  # the metadata settles it
    assert report.trainer == "kohya sd-scripts (or difftune)"
    save_file(tensors, str(tmp_path / "d.safetensors"), metadata={**meta, "difftune.format": "k"})
    assert inspect_file(tmp_path / "d.safetensors").trainer == "difftune"  # its own, named
    assert report.layouts == {"kohya (original names)": len(report.modules)}
    # fused qkv: rank 3 x 4 with alpha 3 x 2 (the same scale, 0.5); single blocks' linear1
    # (q, k, v and the untrained proj_mlp): 4 x 4 and 4 x 2
    assert report.ranks == {"12": 2, "16": 2, "4": 1}
    # the final layer is written with its scale folded in (alpha = rank: scale 1)
    assert report.alphas == {"6.0": 2, "8.0": 2, "4.0": 1}
    assert {m.name: m.scale for m in report.modules if m.scale != 0.5} == {
        "final_layer.linear": 1.0}
    assert report.metadata == {k: v for k, v in meta.items() if k != "unrelated"}
    assert report.blocks == {"double_blocks.0": 1, "double_blocks.1": 1, "final_layer": 1,
                             "single_blocks.0": 1, "single_blocks.1": 1}
    assert list(report.non_finite) == ["lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight"]


def test_adapter_kinds(tmp_path: Path) -> None:
    """LoHa, LoKr, DoRA, full diff and LoCon, by their LyCORIS tensor names."""
    z = torch.zeros
    files = {
        "LoHa": {"hada_w1_a": z(8, 2), "hada_w1_b": z(2, 8), "hada_w2_a": z(8, 2),
                 "hada_w2_b": z(2, 8), "alpha": torch.tensor(2.0)},
        "LoKr": {"lokr_w1": z(2, 2), "lokr_w2_a": z(4, 3), "lokr_w2_b": z(3, 4)},
        "DoRA": {"lora_down.weight": z(2, 8), "lora_up.weight": z(8, 2), "dora_scale": z(8, 1)},
        "full diff": {"diff": z(8, 8), "diff_b": z(8)},
        "LoCon": {"lora_down.weight": z(2, 8, 3, 3), "lora_up.weight": z(8, 2, 1, 1)},
    }
    for kind, parts in files.items():
        tensors = {f"lycoris_layers_0_attention_to_q.{k}": v for k, v in parts.items()}
        report = inspect_file(save_lora(tmp_path / f"{kind}.safetensors", tensors, {}),
                              "z_image")
        assert report.kinds == {kind: 1}, kind
    assert report.layouts == {"LyCORIS (diffusers names)": 1}


def test_cli_text_json_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    state = diffusers_lora("sd3", linear_modules("sd3", r"attn\.to_q$"))
    path = save_lora(tmp_path / "s.safetensors", spelled(state, "transformer.", False, None), {})
    status, out, _ = cli(capsys, "inspect", str(path), "--family", "sd3")
    assert status == 0 and "family:    sd3" in out and "kind:      LoRA (2)" in out
    status, out, _ = cli(capsys, "inspect", str(path), "--json", "--family", "sd3")
    assert json.loads(out)["layouts"] == {"diffusers/PEFT (diffusers names)": 2}
    status, _, err = cli(capsys, "inspect", str(tmp_path / "none.safetensors"))
    assert status == 2 and "none.safetensors" in err and "Traceback" not in err
    other = save_lora(tmp_path / "o.safetensors", {"foo.lora_A.weight": torch.zeros(2, 2)}, {})
    status, _, err = cli(capsys, "verify", str(other))
    assert status == 2 and "o.safetensors" in err and "--family" in err


def test_verify_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0 when every program applies every key, 3 when one drops some (SDXL's diffusers
    attention names, which ComfyUI reads only in the old processor form)."""
    state = diffusers_lora("sdxl", linear_modules("sdxl", r"attn1\.to_q$"))
    path = save_lora(tmp_path / "x.safetensors", state, {})
    status, out, _ = cli(capsys, "verify", str(path), "--family", "sdxl")
    assert status == 3 and "processor form" in out and "expected lora_unet_" in out
    assert out.count("processor form") == 1  # one reason for all its keys: said once
    kohya = save_lora(tmp_path / "k.safetensors", spelled(state, "lora_unet_", True, 4.0,
                                                          ("lora_down.weight", "lora_up.weight")),
                      {})
    status, out, _ = cli(capsys, "verify", str(kohya), "--family", "sdxl")
    assert status == 0 and "Forge/A1111: applies" in out
