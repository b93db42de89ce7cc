"""DoRA's two files against the two formulas: the standard file read by peft's formula, and the
`-comfyui` file read by ComfyUI's (tests/e2e/dora_formulas.py, written from the formulas),
each give the weights the run trained; the standard file read by ComfyUI's formula does not
(so the checks can fail). Through the writer on tiny models (Linear, Conv2d and CLIP layers,
quantized and fp8 bases), and through the real CLI (train, check, sample, --init-lora)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from difftune.adapters.dora_comfyui import base_weight
from difftune.adapters.lycoris_files import adapted_layers
from difftune.cli import main
from difftune.config import load_config
from difftune.errors import CheckpointError, ConfigError
from difftune.families.common.text import file_clip_roots
from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.files import lora_file
from difftune.train.init_lora import load_init_lora

from .conftest import lora_metadata, run_toml
from .dora_formulas import change_error, comfyui_weight, modules_of, peft_weight
from .test_adapter_kinds import manager
from .test_lycoris_files import adapted_run

TIGHT = 5e-5  # of each layer's trained change: float32 rounding, nothing more
FULL = pytest.mark.full_only


def layers_of(m: CheckpointManager) -> dict[str, BaseTunerLayer]:
    """{file module name: peft layer} of a run's adapted layers."""
    return adapted_layers(m.family, m.modules(), file_clip_roots(m.family))


def trained_weight(layer: BaseTunerLayer) -> torch.Tensor:
    """The weight the run trained: peft's own merge of a copy of the layer on a float32 base;
    on a quantized or fp8 one (which a merge would round to its storage again), peft's DoRA
    of the live tensors over the base as the layer computes it (checked here)."""
    stored = layer.get_base_layer().weight
    if type(stored) is torch.nn.Parameter and stored.dtype == torch.float32:
        merged = copy.deepcopy(layer)
        merged.merge()
        return merged.get_base_layer().weight.detach().double()
    base = base_weight(layer, "live").double()
    assert_computed_with(layer.get_base_layer(), base)
    adapted = base + layer.get_delta_weight("default").detach().double()
    magnitude = layer.lora_magnitude_vector["default"].weight.detach().double()
    return magnitude[:, None] * adapted / adapted.norm(dim=1, keepdim=True)


def assert_computed_with(base_layer: torch.nn.Module, weight: torch.Tensor) -> None:
    """The low-bit base layer's output is x @ weight.T + b (to its compute precision)."""
    dtype = next((p.dtype for p in base_layer.parameters() if p.dtype.is_floating_point
                  and p.dtype.itemsize > 1), torch.float32)
    x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(4))
    bias = base_layer.bias.detach().double() if base_layer.bias is not None else 0.0
    with torch.no_grad():
        got = base_layer(x.to(dtype)).double()
    torch.testing.assert_close(got, x.double() @ weight.T + bias, rtol=2e-2, atol=2e-2)


def errors(m: CheckpointManager, standard: Path) -> dict[str, list[float]]:
    """Each module's error (of its trained change) per (file, formula): `standard-peft`,
    `comfyui-comfyui` and `standard-comfyui`."""
    files = {"standard": load_file(str(standard)),
             "comfyui": load_file(str(standard.with_name(standard.stem + "-comfyui.safetensors")))}
    parts = {name: modules_of(t) for name, t in files.items()}
    assert parts["standard"].keys() == parts["comfyui"].keys() and parts["standard"]
    found: dict[str, list[float]] = {"standard-peft": [], "comfyui-comfyui": [],
                                     "standard-comfyui": []}
    layers = layers_of(m)
    for module in parts["standard"]:
        base, want = base_weight(layers[module], module), trained_weight(layers[module])
        for key, formula in (("standard-peft", peft_weight), ("comfyui-comfyui", comfyui_weight),
                             ("standard-comfyui", comfyui_weight)):
            got = formula(base, parts[key.partition("-")[0]][module])
            found[key].append(change_error(got, want, base))
    return found


def assert_formulas(found: dict[str, list[float]], bound: float = TIGHT) -> None:
    """Both files exact (within `bound`) by their own formula; the standard one off by
    ComfyUI's."""
    figures = {k: f"{max(v):.2e}" for k, v in found.items()}
    print(f"max error of the trained change over {len(found['standard-peft'])} modules:",
          figures)
    assert max(found["standard-peft"]) < bound, figures
    assert max(found["comfyui-comfyui"]) < bound, figures
    assert max(found["standard-comfyui"]) > 3e-2, figures


CASES = [
    ("flux", ["adapter.dora=true", 'adapter.text_encoders=["clip_l"]']),
    ("sdxl", ["adapter.type=locon", "adapter.conv_rank=2", "adapter.dora=true"]),
    pytest.param("z_image", ["adapter.dora=true"], marks=FULL),
    # Wan's files name every module by Wan's own names (`lora_unet_blocks_0_self_attn_q`)
    pytest.param("wan", ["adapter.dora=true"], marks=FULL),
]


@pytest.mark.parametrize("family,sets", CASES)
def test_each_file_gives_the_trained_weights_by_its_formula(
        tmp_path: Path, images: Path, family: str, sets: list[str]) -> None:
    m, path = adapted_run(tmp_path, images, family, *sets)
    assert_formulas(errors(m, path))
    standard, comfy = lora_metadata(path), lora_metadata(path.with_name("lora-comfyui.safetensors"))
    assert (standard["difftune.dora_formula"], comfy["difftune.dora_formula"]) == ("peft",
                                                                                    "comfyui")
    # Everything but the magnitudes is the same adapter.
    a, b = load_file(str(path)), load_file(str(path.with_name("lora-comfyui.safetensors")))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a if not k.endswith(".dora_scale"))


# Quantized and fp8-stored bases: the magnitudes are computed from the dequantized weights
# the run trained on (the int8 case with the default tier, the others with --full).
QUANTIZED = {
    "int8": '[precision]\nmixed = "bf16"\n[precision.quantize]\ndenoiser = "int8"\n'
            'text_encoders = "int8"\n',
    "qint8": '[precision]\nmixed = "bf16"\n[precision.quantize]\ndenoiser = "qint8"\n',
    "fp8": '[precision]\nmixed = "bf16"\n[precision.quantize]\ndenoiser = "fp8"\n'
           'text_encoders = "fp8"\n',
}


@pytest.mark.parametrize("base", ["int8", pytest.param("qint8", marks=FULL),
                                  pytest.param("fp8", marks=FULL)])
def test_a_quantized_base_is_dequantized_for_the_comfyui_file(
        tmp_path: Path, images: Path, base: str) -> None:
    if base == "qint8":
        pytest.importorskip("optimum.quanto")
    cfg = run_toml(tmp_path, images, fmt=None, family="flux", extra=QUANTIZED[base])
    m = manager(cfg, "adapter.dora=true", 'adapter.text_encoders=["clip_l"]')
    layers = layers_of(m)
    stored = {type(layer.get_base_layer().weight).__name__ for layer in layers.values()}
    assert stored - {"Parameter"}, stored  # the base really is quantized (or fp8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.trainable().values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    path = m.save_lora(1, final=True)
    assert_formulas(errors(m, path))


def test_dora_on_fp8_storage_is_refused_at_load(tmp_path: Path, images: Path) -> None:
    """peft's DoRA cannot add to fp8-stored weights (it failed inside peft when the adapter
    was added): refused with the fix, naming each part."""
    extra = '[precision]\nmixed = "bf16"\ndenoiser = "fp8"\ntext_encoders = { clip_l = "fp8" }\n'
    cfg = run_toml(tmp_path, images, fmt=None, family="flux", extra=extra)
    with pytest.raises(ConfigError) as err:
        load_config(cfg, ["adapter.dora=true", 'adapter.text_encoders=["clip_l"]'])
    for part in ("precision.denoiser", "precision.text_encoders.clip_l"):
        assert f'adapter.dora with {part} = "fp8": peft\'s DoRA cannot' in str(err.value)
    load_config(cfg, [])  # LoRA on fp8 storage is fine


def test_a_base_weight_that_cannot_be_read_is_refused() -> None:
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], use_dora=True),
                                    torch.nn.Sequential(torch.nn.Linear(4, 3)))
    model[0].base_layer.weight = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.int8),
                                                    requires_grad=False)
    with pytest.raises(CheckpointError, match=r"lycoris_0: its base weight is stored as "
                                              r"Parameter of torch.int8.*dora_comfyui = false"):
        base_weight(model[0], "lycoris_0")


@pytest.mark.parametrize("family", ["flux", pytest.param("z_image", marks=FULL)])
def test_a_dora_run_writes_both_files_and_says_which_to_load_where(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str], family: str) -> None:
    sets = ["adapter.dora=true", "save.every_n_steps=1", "save.dtype=bf16", "train.lr=1e-3"]
    cfg = run_toml(tmp_path, images, steps=2, fmt=None, family=family)
    assert main(["train", str(cfg), "--no-progress"] + [a for s in sets
                                                        for a in ("--set", s)]) == 0
    out = tmp_path / "out"
    # bf16 files, but the magnitudes in float32: bf16's rounding of them alone put each file
    # 10-15% of the trained change off by its own formula.
    saved = load_file(str(out / "lora-comfyui.safetensors"))
    assert {v.dtype for k, v in saved.items() if k.endswith(".dora_scale")} == {torch.float32}
    assert {v.dtype for k, v in saved.items() if k.endswith("_up.weight")} == {torch.bfloat16}
    names = {p.name for p in out.glob("*.safetensors")}
    assert names == {"lora.safetensors", "lora-comfyui.safetensors",
                     "lora-step000001.safetensors", "lora-step000001-comfyui.safetensors"}
    ckpt = sorted((out / "checkpoints").glob("step-*"))[-1]
    assert (ckpt / "lora-comfyui.safetensors").is_file()
    assert lora_file(ckpt) == ckpt / "lora.safetensors"
    # The trained adapter (the checkpoint's) read from the standard file into a fresh run.
    m = manager(cfg, *sets)
    load_init_lora(out / "lora.safetensors", m)  # (refuses nothing: the standard file)
    trained = load_file(str(ckpt / "trainable.safetensors"))
    with torch.no_grad():  # the trained adapter as the checkpoint holds it (float32)
        for key, value in trained.items():
            m.trainable()[key].copy_(value)
    # The up/down factors' bf16 rounding leaves under 1% of the change (measured: 0.4%).
    assert_formulas(errors(m, out / "lora.safetensors"), bound=1e-2)
    # Where each file goes: check says it; difftune's own readers refuse the ComfyUI file.
    capsys.readouterr()
    fresh = run_toml(tmp_path / "check", images, steps=2, fmt=None, family=family)
    assert main(["check", str(fresh), "--set", "adapter.dora=true"]) == 0
    said = capsys.readouterr().out
    assert ("DoRA: load lora.safetensors in diffusers/peft, LyCORIS and difftune, and "
            "lora-comfyui.safetensors in ComfyUI and Forge") in said
    with pytest.raises(CheckpointError, match="is the ComfyUI DoRA file.*use the standard "
                                              "file of the same save, lora.safetensors"):
        load_init_lora(out / "lora-comfyui.safetensors", manager(cfg, *sets))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 1\n", encoding="utf-8")
    assert main(["sample", str(cfg), "--prompts", str(prompts), "--lora",
                 str(out / "lora-step000001-comfyui.safetensors")]) == 2
    assert "use the standard file of the same save, lora-step000001.safetensors" in \
        capsys.readouterr().err


def test_the_run_pages_list_a_comfyui_file_as_its_twin(tmp_path: Path, images: Path) -> None:
    from difftune.ui.run_outputs import files

    m, path = adapted_run(tmp_path, images, "flux", "adapter.dora=true")
    m.save_lora(3)
    listed = {Path(f.path).name: (f.step, f.final, f.kind) for f in files(path.parent)}
    assert listed["lora-step000003-comfyui.safetensors"] == (3, False, "lora")
    assert listed["lora-comfyui.safetensors"] == listed["lora.safetensors"]


def test_dora_comfyui_off_writes_the_standard_file_alone_and_check_says_so(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m, path = adapted_run(tmp_path, images, "flux", "adapter.dora=true",
                          "save.dora_comfyui=false")
    assert sorted(p.name for p in path.parent.glob("*.safetensors")) == ["lora.safetensors"]
    assert lora_metadata(path)["difftune.dora_formula"] == "peft"
    fresh = run_toml(tmp_path / "check", images, fmt=None, family="flux")
    capsys.readouterr()
    assert main(["check", str(fresh), "--set", "adapter.dora=true", "--set",
                 "save.dora_comfyui=false"]) == 0
    assert ("ComfyUI and Forge read its magnitudes by another formula (rows off by "
            "||W+dW||/||W||): set save.dora_comfyui = true") in capsys.readouterr().out
