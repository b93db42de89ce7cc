"""`difftune lora convert`: any trainer's spelling in, each layout out, the same update; round
trips exact; refusals (a LoKr in diffusers' PEFT layout, a layout the family lacks, an
existing output) exit 2 with the reason and write nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.adapters.formats import save_lora
from difftune.cli import main
from difftune.families import registry
from difftune.lora_tools.convert import convert

from ..lora_files import TRAINERS, diffusers_lora, linear_modules, tiny


def close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys, same values (to float rounding)."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), rtol=1e-5, atol=1e-6,
                                   msg=key)


@pytest.mark.parametrize("family", ["flux", "z_image", "flux2"])
def test_every_spelling_converts_back_to_the_same_diffusers_lora(tmp_path: Path,
                                                                 family: str) -> None:
    fam = registry.get(family)
    state = diffusers_lora(family, linear_modules(family, r"attn\.to_[qkv]$|to_out"))
    files = {name: spell(state, fam.denoiser_prefix) for name, spell in TRAINERS.items()}
    for fmt in fam.formats:
        if fmt != "diffusers":
            files[fmt] = fam.lora_to_format(tiny(family), state, fmt, 4, 4.0)
    for name, tensors in files.items():
        source = save_lora(tmp_path / f"{name}.safetensors", tensors, {})
        report = convert(source, "diffusers", family=family)
        close(load_file(report.path), state)
        assert report.applies["diffusers"].endswith("drops 0 key(s)"), name


def test_round_trips_through_kohya_and_comfy(tmp_path: Path) -> None:
    state = diffusers_lora("flux", linear_modules("flux"))
    source = save_lora(tmp_path / "d.safetensors", state, {})
    kohya = convert(source, "kohya", tmp_path / "k.safetensors")
    assert kohya.applies["ComfyUI (4f874c5e: comfy/lora.py, comfy/weight_adapter)"].endswith(
        "drops 0 key(s)")
    close(load_file(convert(Path(kohya.path), "diffusers", tmp_path / "back.safetensors").path),
          state)
    comfy = convert(source, "comfy", tmp_path / "c.safetensors")
    assert comfy.layout == registry.spec("flux").default_format
    close(load_file(comfy.path), state)


def test_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lokr = save_lora(tmp_path / "lokr.safetensors",
                     {"lycoris_layers_0_attention_to_q.lokr_w1": torch.ones(2, 2),
                      "lycoris_layers_0_attention_to_q.lokr_w2": torch.ones(32, 32)}, {})
    assert main(["lora", "convert", str(lokr), "--to", "diffusers"]) == 2
    assert "is a LoKr" in capsys.readouterr().err
    assert not (tmp_path / "lokr-diffusers.safetensors").exists()
    assert main(["lora", "convert", str(lokr), "--to", "comfy"]) == 0
    assert "lycoris_layers_0_attention_to_q.lokr_w1" in load_file(
        str(tmp_path / "lokr-comfy.safetensors"))
    modulation = save_lora(tmp_path / "m.safetensors", {  # ComfyUI drops this spelling
        "lycoris_double_stream_modulation_img_linear.lokr_w1": torch.ones(2, 2),
        "lycoris_double_stream_modulation_img_linear.lokr_w2": torch.ones(96, 16)}, {})
    report = convert(modulation, "comfy", family="flux2")
    assert sorted(load_file(report.path)) == [
        "diffusion_model.double_stream_modulation_img.lin.lokr_w1",
        "diffusion_model.double_stream_modulation_img.lin.lokr_w2"]
    assert report.applies["diffusers"].startswith("0 modules")  # (the LoKr is not counted)
    assert next(v for k, v in report.applies.items() if k.startswith("ComfyUI")) == \
        "2 keys, drops 0 key(s)"
    z = save_lora(tmp_path / "z.safetensors", diffusers_lora(
        "z_image", linear_modules("z_image", r"to_q$")), {})
    assert main(["lora", "convert", str(z), "--to", "kohya"]) == 2
    assert "no kohya layout" in capsys.readouterr().err
    assert main(["lora", "convert", str(lokr), "--to", "comfy"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_converted_file_loads_in_diffusers_as_the_source(tmp_path: Path) -> None:
    """A kohya FLUX.1 file (double blocks: diffusers' converter reads them) converted to the
    diffusers layout: diffusers fuses the same weights as from the diffusers-named source."""
    from difftune.lora_tools.names import tiny_components

    state = diffusers_lora("flux", linear_modules("flux", r"^transformer_blocks"))
    kohya = save_lora(tmp_path / "k.safetensors", registry.get("flux").lora_to_format(
        tiny("flux"), state, "kohya", 4, 2.0), {})
    source = save_lora(tmp_path / "d.safetensors", {
        k: v * 0.5 if k.endswith("lora_B.weight") else v for k, v in state.items()}, {})
    converted = Path(convert(kohya, "diffusers").path)
    fused = []
    for path in (source, converted):
        comps = tiny_components("flux")
        pipe = registry.get("flux").pipeline(comps)
        pipe.load_lora_weights(str(path))
        pipe.fuse_lora()
        fused.append(comps.denoiser.state_dict())
    for key, value in fused[0].items():
        torch.testing.assert_close(fused[1][key], value, rtol=1e-6, atol=1e-6, msg=key)
