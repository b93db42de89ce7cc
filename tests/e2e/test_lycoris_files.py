"""LoCon, LoHa, LoKr and DoRA files checked against the LyCORIS library.

A run's adapter (set to random values, as training would leave it) is saved through the run's
own writer; the LyCORIS library then builds its modules from the SAVED FILE on a copy of the
base model (`create_lycoris_from_weights` for the `lycoris_` names of the diffusers-layout
families, `lycoris.kohya.create_network_from_weights` for SDXL's `lora_unet_`/`lora_teN_`
ones) and merges them. The merged weights must equal peft's merge of the run's own layers.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from lycoris.wrapper import create_lycoris_from_weights
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from difftune import families
from difftune.adapters.lycoris_files import standard_names
from difftune.config import load_config
from difftune.families.common.text import model_clip_roots
from difftune.train.checkpoint import CheckpointManager
from difftune.train.setup import prepare

from .conftest import run_toml, tiny_pipeline


def adapted_run(folder: Path, images: Path, family: str, *sets: str
                ) -> tuple[CheckpointManager, Path]:
    """A prepared run of `family`'s tiny flavor whose adapter holds random values, and the
    file its writer saved."""
    cfg = load_config(run_toml(folder, images, fmt=None, family=family), list(sets))
    run = prepare(cfg, show_progress=False)
    manager = CheckpointManager(cfg, run.family, run.comps, run.targets, {})
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in manager.trainable().values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return manager, manager.save_lora(1, final=True)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` with every peft layer replaced by its base layer (the base model)."""
    base = copy.deepcopy(model)
    for name, layer in list(base.named_modules()):
        if isinstance(layer, BaseTunerLayer):
            parent, _, child = name.rpartition(".")
            setattr(base.get_submodule(parent) if parent else base, child, layer.get_base_layer())
    return base


def peft_merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{module name: weight} of every adapted layer after peft's own merge."""
    merged = copy.deepcopy(model)
    out = {}
    for name, layer in merged.named_modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge()
            out[name] = layer.get_base_layer().weight.detach().clone()
    return out


def lycoris_modules(manager: CheckpointManager, path: Path) -> list[tuple[str, str, object]]:
    """(component prefix, module name, LyCORIS module) for every module LyCORIS's
    `create_lycoris_from_weights` built from the saved file on copies of the base modules.

    The file's component prefixes (`lycoris_`, SDXL's `lora_unet_`, `lora_teN_`) are renamed
    to the wrapper's `lycoris_` per component; the rest of each name is LyCORIS's own lookup
    of the module by its dotted name. Modules a family names for ComfyUI (FLUX.2's shared
    modulation layers as `lora_unet_<BFL name>`) go back to their `lycoris_` names first, as
    difftune hands them to the wrapper (`standard_names`)."""
    family = manager.family
    weights = standard_names(family, load_file(str(path)))
    names = {family.denoiser_prefix: family.lycoris_prefix}
    names |= {p: f"lora_te{i}" for i, p in enumerate(family.text_encoder_prefixes.values(), 1)}
    found = []
    for prefix, model in manager.modules().items():
        base = unwrapped(model)
        # Files name CLIP modules under `text_model.` (as every reader maps them); a live
        # transformers-5 CLIPTextModel has no such root, so its names go without it here.
        head = names[prefix] + "_" + ("text_model_" if prefix in flattened_clips(manager) else "")
        mine = {"lycoris_" + k.removeprefix(head): v for k, v in weights.items()
                if k.startswith(names[prefix] + "_")}
        net, _ = create_lycoris_from_weights(1.0, "", base, weights_sd=mine)
        where = {id(m): n for n, m in base.named_modules()}
        found += [(prefix, where[id(lora.org_module[0])], lora) for lora in net.loras]
    return found


def flattened_clips(manager: CheckpointManager) -> set[str]:
    """The prefixes of the CLIP encoders whose live modules lack the `text_model.` root."""
    roots = model_clip_roots(manager.family, manager.comps)
    return {prefix for prefix, root in roots.items() if root == ""}


def same_output(peft_layer: torch.nn.Module, lyco: torch.nn.Module) -> None:
    """The peft layer and the LyCORIS module give the same output on a random input."""
    base = peft_layer.get_base_layer()
    gen = torch.Generator().manual_seed(2)
    shape = ((3, base.in_features) if isinstance(base, torch.nn.Linear)
             else (1, base.in_channels, 6, 6))
    x = torch.randn(shape, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(lyco(x), peft_layer(x), rtol=1e-4, atol=1e-5)


FULL = pytest.mark.full_only
# Each kind by default: LoKr (split and whole) on FLUX.1's `lycoris_` layout, LoCon with DoRA
# and LoHa (with a CLIP encoder) on SDXL's `lora_unet_` one with Conv2d layers; the other
# kind/option/family cells with --full.
CASES = [
    ("flux", ["adapter.type=lokr", "adapter.rank=2"], "lokr_w2_a"),
    ("flux", ["adapter.type=lokr", "adapter.full_matrix=true"], "lokr_w2"),
    pytest.param("flux", ["adapter.type=loha"], "hada_w2_b", marks=FULL),
    pytest.param("flux", ["adapter.dora=true"], "dora_scale", marks=FULL),
    ("sdxl", ["adapter.type=locon", "adapter.conv_rank=2", "adapter.conv_alpha=3",
              "adapter.dora=true"], "dora_scale"),
    pytest.param("sdxl", ["adapter.type=lokr", "adapter.rank=1", "adapter.decompose_both=true",
                          "adapter.factor=4", "adapter.conv_rank=2"], "lokr_w1_a", marks=FULL),
    ("sdxl", ["adapter.type=loha", "adapter.conv_rank=2",
              'adapter.text_encoders=["clip_l"]'], "hada_w1_a"),
]


def _every_family() -> list:
    """LoKr (with a text encoder where the family's can get one) on every family, --full."""
    from .test_precision_matrix import trained_encoder

    cases = []
    for name in families.names():
        encoder, refused = trained_encoder(name)
        sets = ["adapter.type=lokr", "adapter.rank=2"]
        sets += [] if refused else [f'adapter.text_encoders=["{encoder}"]']
        cases.append(pytest.param(name, sets, "lokr_w1", marks=FULL, id=f"{name}-lokr"))
    return cases


@pytest.mark.parametrize("family,sets,factor", CASES + _every_family())
def test_lycoris_reads_the_saved_file_as_trained(tmp_path: Path, images: Path, family: str,
                                                 sets: list[str], factor: str) -> None:
    manager, path = adapted_run(tmp_path, images, family, *sets)
    keys = load_file(str(path)).keys()
    assert any(k.endswith("." + factor) for k in keys), sorted(keys)[:8]
    modules = manager.modules()
    loaded = lycoris_modules(manager, path)
    assert len(loaded) == len({k.partition(".")[0] for k in keys})  # LyCORIS read them all
    merged = {prefix: peft_merged(m) for prefix, m in modules.items()}
    for prefix, name, lyco in loaded:
        lyco.eval()
        same_output(modules[prefix].get_submodule(name), lyco)
        if type(lyco).__name__ != "LoConModule" and lyco.scale != 1:
            # LyCORIS 4.1.3's LoHa/LoKr `get_diff_weight` (what merge_to uses) applies alpha/dim
            # twice, its forward and ComfyUI once: merges are compared where the scale is 1.
            continue
        lyco.merge_to(1.0)
        torch.testing.assert_close(lyco.org_module[0].weight, merged[prefix][name], rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{prefix}.{name}: {m}")


def test_diffusers_loads_an_sdxl_locon_file_exactly(tmp_path: Path, images: Path) -> None:
    """diffusers' kohya converter reads SDXL LoCon files (Linear and Conv2d layers) into peft:
    fused, its UNet equals the run's merged one. (diffusers 0.42 drops `dora_scale` from SD
    and SDXL files with a warning and reads no LoHa/LoKr, so only LoCon is checked here.)"""
    manager, path = adapted_run(tmp_path, images, "sdxl", "adapter.type=locon",
                                "adapter.conv_rank=2", "adapter.conv_alpha=3")
    pipe = tiny_pipeline("sdxl")
    pipe.load_lora_weights(str(path))
    pipe.fuse_lora()
    theirs = dict(pipe.unet.named_modules())
    ours = peft_merged(manager.comps.denoiser)
    assert any(w.ndim == 4 for w in ours.values())  # conv layers are among them
    for name, weight in ours.items():
        layer = theirs[name]
        base = layer.get_base_layer() if isinstance(layer, BaseTunerLayer) else layer
        torch.testing.assert_close(base.weight, weight, rtol=1e-5, atol=1e-6, msg=name)
