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
from difftune.files.single import write_layout
from difftune.families import registry
from difftune.lora_tools.convert import convert

from ..lora_files import TRAINERS, diffusers_lora, in_original_names, linear_modules, tiny
from .conftest import run_toml


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
    kohya = convert(source, "kohya", tmp_path / "k.safetensors", base=tmp_path)
    assert kohya.names_of.startswith("--base ignored")  # (FLUX.1's names need no model)
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
    assert "no kohya layout (ComfyUI and diffusers read" in capsys.readouterr().err
    assert main(["lora", "convert", str(lokr), "--to", "comfy"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_messages_name_only_the_readers_there_are(tmp_path: Path, images: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """ComfyUI loads no FLUX.3 model: `check`'s LoRA-format line and convert's refusal of a
    kohya layout say diffusers reads the default layout, and why ComfyUI does not, instead of
    naming both readers."""
    cfg = run_toml(tmp_path, images, fmt=None, family="flux3")
    assert main(["check", str(cfg)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "LoRA file format" in x)
    assert "the layout diffusers reads fully (ComfyUI at 4f874c5e has no FLUX.3 model" in line
    flux3 = save_lora(tmp_path / "f3.safetensors", diffusers_lora(
        "flux3", linear_modules("flux3", r"to_q$")), {})
    assert main(["lora", "convert", str(flux3), "--to", "kohya"]) == 2
    assert "(diffusers reads its diffusers layout: --to comfy; ComfyUI at 4f874c5e has no " \
        "FLUX.3 model" in capsys.readouterr().err


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


# Families whose original names depend on the model's layout: the tiny flavor's modules the
# test LoRA trains (attention and feed-forward, the first and the last, pre-only, block).
LAYOUT_MODULES = {"sdxl": r"attn1\.to_q$|attn2\.to_out\.0$|ff\.net\.2$|time_embedding",
                  "sd15": r"attn1\.to_q$|attn2\.to_out\.0$|ff\.net\.2$|time_embedding",
                  "sd3": r"attn\.to_out\.0$|norm1_context\.linear|ff_context\.net\.2$"}

# Where diffusers' load_lora_weights reads the original names right: SDXL's (it passes the
# UNet's config to its SGM remapper); SD3 has no kohya reader, and SD 1.5's LDM names are
# not remapped by load_lora_weights (they land on modules the UNet lacks).
DIFFUSERS_READS_ORIGINAL = {"sdxl"}


def _fused(family: str, path: Path) -> dict[str, torch.Tensor]:
    """The tiny denoiser's weights with the LoRA file at `path` fused by diffusers' loader."""
    from difftune.lora_tools.names import tiny_components

    comps = tiny_components(family)
    pipe = registry.get(family).pipeline(comps)
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    return {k.replace(".base_layer.", "."): v for k, v in comps.denoiser.state_dict().items()
            if ".lora_" not in k}


@pytest.mark.parametrize("family", sorted(LAYOUT_MODULES))
def test_original_names_convert_with_the_base_models_layout(
        tmp_path: Path, family: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny model's kohya file: its layout is not a released model's, so convert exits 2
    naming --base; with --base (the tiny model's folder, or its single file) it converts to
    diffusers and back exactly, and diffusers loads the converted file as the diffusers-named source, and as
    the original-named file where diffusers reads that (SDXL's)."""
    fam = registry.get(family)
    state = diffusers_lora(family, linear_modules(family, LAYOUT_MODULES[family]))
    source = save_lora(tmp_path / "source.safetensors", state, {})
    layout = fam.lora_to_format(tiny(family), state, "kohya", 4, 4.0)
    kohya = save_lora(tmp_path / "k.safetensors", in_original_names(family, layout), {})
    args = ["lora", "convert", str(kohya), "--to", "diffusers", "--family", family]
    assert main(args) == 2
    assert "pass --base MODEL" in capsys.readouterr().err
    assert main([*args, "--base", str(tmp_path)]) == 2  # a folder of no model
    assert f"--base {tmp_path}: not a {family} model folder" in capsys.readouterr().err
    assert main([*args, "--base", str(kohya)]) == 2  # a file of no model
    assert f"--base {kohya}: not a {family} model" in capsys.readouterr().err
    (tmp_path / "model.ckpt").write_bytes(b"not safetensors")
    assert main([*args, "--base", str(tmp_path / "model.ckpt")]) == 2
    assert "not a readable .safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "k-diffusers.safetensors").exists()
    base = tmp_path / "model"
    tiny(family).denoiser.save_config(base / fam.spec.denoiser_part)
    assert main([*args, "--base", str(base)]) == 0
    assert f"original names in the layout of --base {base}" in capsys.readouterr().out
    converted = tmp_path / "k-diffusers.safetensors"
    close(load_file(converted), state)
    back = convert(converted, "kohya", tmp_path / "back.safetensors", family, base=base)
    close(load_file(back.path), layout)
    single = tmp_path / "model.safetensors"  # the model as its original single file
    write_layout(single, fam.single_file_layout(tiny(family)), tiny(family).denoiser.state_dict(),
                 torch.float32)
    close(load_file(convert(kohya, "diffusers", tmp_path / "f.safetensors", family,
                            base=single).path), state)
    got = _fused(family, converted)
    for reference in [source] + ([kohya] if family in DIFFUSERS_READS_ORIGINAL else []):
        for key, value in _fused(family, reference).items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6, msg=key)


def _pair(down: tuple[int, ...], rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random (down, up) factors of rank 2 (a conv's when `down` has a kernel)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, *down, generator=gen),
            torch.randn(rows, 2, *[1] * (len(down) - 1), generator=gen))


# Released models' modules, (diffusers name, original name as kohya/A1111/ComfyUI write it,
# input width (a conv's: with its kernel), output width, whether the original's output halves are swapped), from the
# released checkpoints' layouts: SDXL's up level 0 is output_blocks 0-2 (10-deep attention),
# its level-1 resnet 1 input_blocks.5; SD 1.5's last attention output_blocks.11; SD3.5
# large's 38th block pre-only, its context modulation (shift, scale) where diffusers' is
# (scale, shift); SD3.5 medium's 24th likewise.
RELEASED = {
    "sdxl": [("up_blocks.0.attentions.2.transformer_blocks.9.attn1.to_q",
              "output_blocks_2_1_transformer_blocks_9_attn1_to_q", 1280, 1280, False),
             ("down_blocks.1.resnets.1.time_emb_proj", "input_blocks_5_0_emb_layers_1",
              1280, 640, False),
             ("down_blocks.1.resnets.1.conv1", "input_blocks_5_0_in_layers_2", (640, 3, 3),
              640, False)],  # a LoCon's conv
    "sd15": [("up_blocks.3.attentions.2.transformer_blocks.0.ff.net.2",
              "output_blocks_11_1_transformer_blocks_0_ff_net_2", 1280, 320, False),
             ("down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k",
              "input_blocks_2_1_transformer_blocks_0_attn2_to_k", 768, 320, False)],
    "sd3": [("transformer_blocks.37.norm1_context.linear",
             "joint_blocks_37_context_block_adaLN_modulation_1", 2432, 4864, True),
            ("transformer_blocks.37.ff.net.2", "joint_blocks_37_x_block_mlp_fc2", 9728, 2432,
             False)],
    "sd3-medium": [("transformer_blocks.23.norm1_context.linear",
                    "joint_blocks_23_context_block_adaLN_modulation_1", 1536, 3072, True)],
}


@pytest.mark.parametrize("model", sorted(RELEASED))
def test_original_names_of_a_released_model_convert_without_base(tmp_path: Path,
                                                                 model: str) -> None:
    """A released model's original-named file (its names and widths tell which): to
    diffusers and back to kohya with no --base, each module where the released layout puts
    it, the values unchanged (alpha folded), swapped halves swapped back."""
    family = model.partition("-")[0]
    original, want = {}, {}
    for i, (module, name, width, rows, swap) in enumerate(RELEASED[model]):
        down, up = _pair(width if isinstance(width, tuple) else (width,), rows, i)
        original |= {f"lora_unet_{name}.lora_down.weight": down,
                     f"lora_unet_{name}.lora_up.weight": up,
                     f"lora_unet_{name}.alpha": torch.tensor(1.0)}
        halves = up.chunk(2)
        prefix = f"{registry.get(family).denoiser_prefix}.{module}"
        want[f"{prefix}.lora_A.weight"] = down
        want[f"{prefix}.lora_B.weight"] = (torch.cat(halves[::-1]) if swap else up) / 2
    source = save_lora(tmp_path / "o.safetensors", original, {})
    converted = convert(source, "diffusers", family=family)
    assert converted.names_of.startswith("original names in the layout of stable-diffusion-")
    close(load_file(converted.path), want)
    if family != "sd15":  # (SD 1.5's kohya layout is in diffusers' names)
        back = convert(Path(converted.path), "kohya", tmp_path / "b.safetensors", family)
        close(load_file(back.path), {k: v / 2 if k.endswith("up.weight") else
                                     torch.tensor(2.0) if k.endswith("alpha") else v
                                     for k, v in original.items()})
