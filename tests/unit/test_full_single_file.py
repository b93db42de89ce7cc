"""The single files a full fine-tune writes, read back by diffusers' own `from_single_file`
(an independent reader) with the tiny flavor's config, offline: every tensor equal to the
model's (fp32), or to its cast (bf16)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from difftune import families
from difftune.config.sections import ModelConfig, PrecisionConfig
from difftune.files.single import write_layout
from difftune.precision.policy import PrecisionPolicy

CPU = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))


def _randomized(family: str) -> tuple[object, torch.nn.Module]:
    """The family and its tiny denoiser with every weight random (zero-initialized layers
    would hide a wrong order of halves)."""
    fam = families.get(family)
    model = fam.load(ModelConfig(family=family, flavor="tiny"), CPU).denoiser
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return fam, model


def _written(fam: object, model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> Path:
    path = folder / "model.safetensors"  # the layout reads only the components' denoiser
    write_layout(path, fam.single_file_layout(SimpleNamespace(denoiser=model)),
                 model.state_dict(), dtype)
    model.save_config(folder / "config")
    return path


@pytest.mark.parametrize("family, dtype", [
    ("sdxl", torch.float32), ("sd3", torch.bfloat16), ("z_image", torch.float32),
    ("flux2", torch.bfloat16), ("krea2", torch.float32), ("wan", torch.bfloat16),
    pytest.param("qwen_image", torch.float32, marks=pytest.mark.full_only),
    ("ernie_image", torch.bfloat16)])
def test_single_file_loads_with_from_single_file(tmp_path: Path, family: str,
                                                 dtype: torch.dtype) -> None:
    fam, model = _randomized(family)
    path = _written(fam, model, tmp_path, dtype)
    keys = load_file(str(path)).keys()  # a valid safetensors file, in the original names
    unprefixed = ("qwen_image", "z_image", "flux2", "krea2", "wan", "ernie_image")
    assert family in unprefixed or all(k.startswith("model.diffusion_model.") for k in keys)
    theirs = type(model).from_single_file(str(path), config=str(tmp_path / "config"),
                                          local_files_only=True, torch_dtype=dtype).state_dict()
    ours = model.state_dict()
    assert theirs.keys() == ours.keys()
    for key, value in ours.items():
        assert torch.equal(theirs[key], value.to(dtype)), key


def test_flux_bfl_file_reads_back_through_diffusers_converter(tmp_path: Path) -> None:
    """The tiny FLUX.1 through diffusers' BFL converter (our loader gives it the single blocks'
    real width, which diffusers' from_single_file fixes at 3072; the full-width case is
    below), with BFL's own names."""
    from difftune.families.flux.files import load_transformer_file

    fam, model = _randomized("flux")
    path = _written(fam, model, tmp_path, torch.float32)
    keys = load_file(str(path)).keys()
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight",
            "final_layer.adaLN_modulation.1.weight", "time_in.in_layer.weight"} <= keys
    back = load_transformer_file(path, torch.float32).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


# diffusers' FLUX.1 and Chroma converters split the single blocks' `linear1` at the released
# width (3072): one double and one single block of that width (about 0.5 B parameters).
WIDE = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=64,
            axes_dims_rope=(16, 56, 56))


@pytest.mark.full_only
@pytest.mark.parametrize("cls, module, extra", [
    ("FluxTransformer2DModel", "flux", dict(pooled_projection_dim=64, guidance_embeds=True)),
    ("ChromaTransformer2DModel", "chroma", dict(approximator_hidden_dim=64,
                                                approximator_layers=2))])
def test_bfl_full_width_file_loads_with_from_single_file(tmp_path: Path, cls: str, module: str,
                                                         extra: dict) -> None:
    import importlib

    import diffusers

    model_cls = getattr(diffusers, cls)
    layout = importlib.import_module(f"difftune.families.{module}.files").single_file_layout
    config = {**WIDE, **extra}
    model = model_cls(**config).to(torch.bfloat16)
    path = tmp_path / "model.safetensors"
    write_layout(path, layout(model), model.state_dict(), torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": cls, **config}))
    theirs = model_cls.from_single_file(str(path), config=str(tmp_path), local_files_only=True,
                                        torch_dtype=torch.bfloat16).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key


def test_sd35_medium_dual_attention_file_loads_with_from_single_file(tmp_path: Path) -> None:
    """SD3.5 Medium's MMDiT-X blocks (a second image attention, `attn2`) in the MMDiT layout."""
    from diffusers import SD3Transformer2DModel

    from difftune.families.sd3.files import single_file_layout
    from difftune.families.sd3.tiny import TINY_SD3_TRANSFORMER_CONFIG

    model = SD3Transformer2DModel(**{**TINY_SD3_TRANSFORMER_CONFIG, "dual_attention_layers": (0,)})
    path = tmp_path / "model.safetensors"
    write_layout(path, single_file_layout(model), model.state_dict(), torch.float32)
    assert "model.diffusion_model.joint_blocks.0.x_block.attn2.qkv.weight" in load_file(str(path))
    model.save_config(tmp_path / "config")
    theirs = SD3Transformer2DModel.from_single_file(str(path), config=str(tmp_path / "config"),
                                                    local_files_only=True).state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(theirs[key], value), key


def test_chroma_layout_covers_the_tiny_model() -> None:
    """Chroma's layout places every tensor once (its from_single_file check is at the
    released width, in --full)."""
    fam, model = _randomized("chroma")
    layout = fam.single_file_layout(SimpleNamespace(denoiser=model))
    assert {"double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight",
            "distilled_guidance_layer.norms.0.scale", "final_layer.linear.weight"} <= set(layout)
