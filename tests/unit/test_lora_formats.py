"""LoRA file formats for FLUX.1, checked against diffusers' own loaders.

A tiny FluxTransformer2DModel gets a peft LoRA (alpha != rank) with random nonzero up factors.
Its state is written as a diffusers file and as a kohya/ComfyUI file, each file is loaded by
diffusers into a fresh copy of the base model, and the outputs must match the peft model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel
from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from difftune.adapters.formats import (
    LoraPair,
    diffusers_adapter_metadata,
    group_modules,
    load_lora_file,
    peft_state_to_diffusers,
    save_lora,
)
from difftune.adapters.fused import fuse_loras, split_fused_lora
from difftune.families.flux.keys import diffusers_to_kohya, kohya_to_diffusers

from .conftest import lora_modules, problems

RANK, ALPHA = 4, 8.0
CONFIG = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
# diffusers' kohya reader splits single_blocks_N_linear1 with full-size FLUX.1 row counts, so
# these parts are checked through diffusers separately, at full size (see below).
LINEAR1_PARTS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def base() -> FluxTransformer2DModel:
    """The seeded tiny base transformer."""
    torch.manual_seed(0)
    return FluxTransformer2DModel(**CONFIG).eval()


def fresh_copy(base: FluxTransformer2DModel) -> FluxTransformer2DModel:
    """A new transformer with the base weights and no adapter."""
    model = FluxTransformer2DModel(**CONFIG).eval()
    model.load_state_dict(base.state_dict())
    return model


def linear_names(model: torch.nn.Module) -> list[str]:
    """Names of every nn.Linear in the model."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))


def block_linears(model: torch.nn.Module) -> list[str]:
    """Every linear layer of the double and single blocks (attention, MLP, modulation)."""
    return [n for n in linear_names(model) if n.startswith(("transformer_blocks.", "single_transformer_blocks."))]


def with_lora(base: FluxTransformer2DModel, targets: list[str], seed: int = 1) -> FluxTransformer2DModel:
    """A copy of the base with a peft LoRA on exactly `targets` and seeded random nonzero factors."""
    model = fresh_copy(base)
    pattern = "^(?:" + "|".join(t.replace(".", r"\.") for t in targets) + ")$"
    inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=pattern), model)
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            param.data = torch.randn(param.shape, generator=gen) * 0.1
    return model


def inputs() -> dict[str, torch.Tensor]:
    """Seeded forward inputs for a 4x4-token image and 8 text tokens."""
    gen = torch.Generator().manual_seed(2)
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1] = torch.arange(16) // 4
    img_ids[:, 2] = torch.arange(16) % 4
    return dict(
        hidden_states=torch.randn(1, 16, 64, generator=gen),
        encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
        pooled_projections=torch.randn(1, 32, generator=gen),
        timestep=torch.tensor([0.5]),
        img_ids=img_ids,
        txt_ids=torch.zeros(8, 3),
        guidance=torch.tensor([3.5]),
    )


@torch.no_grad()
def output(model: FluxTransformer2DModel) -> torch.Tensor:
    """The model's output on the fixed inputs."""
    return model(**inputs(), return_dict=False)[0]


def load_with_diffusers(base: FluxTransformer2DModel, path: Path) -> tuple[FluxTransformer2DModel, dict, list[str]]:
    """Load a LoRA file the way `FluxPipeline.load_lora_weights` does, into a fresh base copy.

    Returns the model, the state dict diffusers converted the file to, and any warnings."""
    model = fresh_copy(base)
    with problems() as messages:
        state, alphas, metadata = FluxPipeline.lora_state_dict(
            str(path), return_alphas=True, return_lora_metadata=True
        )
        converted = dict(state)
        FluxPipeline.load_lora_into_transformer(state, network_alphas=alphas, transformer=model, metadata=metadata)
    return model, converted, messages


def pairs_of(model: torch.nn.Module) -> dict[str, LoraPair]:
    """The peft model's LoRA as {`transformer.<module>`: LoraPair}."""
    return group_modules(peft_state_to_diffusers(get_peft_model_state_dict(model)), ALPHA)


def assert_same_deltas(a: dict[str, LoraPair], b: dict[str, LoraPair]) -> None:
    """Same modules, same weight change per module."""
    assert set(a) == set(b)
    for module in a:
        torch.testing.assert_close(a[module].delta(), b[module].delta(), atol=1e-6, rtol=1e-5, msg=module)


# ---------------------------------------------------------------- diffusers format


def test_diffusers_file_loads_in_diffusers_with_alpha(base: FluxTransformer2DModel, tmp_path: Path) -> None:
    peft_model = with_lora(base, block_linears(base))
    state = peft_state_to_diffusers(get_peft_model_state_dict(peft_model))
    metadata = diffusers_adapter_metadata(state, RANK, ALPHA)
    path = save_lora(tmp_path / "lora.safetensors", state, metadata, torch.float32)

    loaded, converted, messages = load_with_diffusers(base, path)

    assert messages == []
    assert converted.keys() == state.keys()
    assert lora_modules(loaded) == lora_modules(peft_model) == set(block_linears(base))
    expected = output(peft_model)
    assert (expected - output(base)).abs().max() > 1e-2  # the LoRA really changes the output
    torch.testing.assert_close(output(loaded), expected, atol=1e-5, rtol=1e-5)


def test_diffusers_file_without_metadata_loads_with_scale_one(
    base: FluxTransformer2DModel, tmp_path: Path
) -> None:
    """Why the metadata is written: without it diffusers assumes alpha = rank."""
    peft_model = with_lora(base, block_linears(base))
    state = peft_state_to_diffusers(get_peft_model_state_dict(peft_model))
    path = save_lora(tmp_path / "bare.safetensors", state, {"format": "pt"}, torch.float32)
    loaded, _, _ = load_with_diffusers(base, path)
    assert not torch.allclose(output(loaded), output(peft_model), atol=1e-4)


# ---------------------------------------------------------------- kohya format


def test_kohya_file_loads_in_diffusers_with_alpha(base: FluxTransformer2DModel, tmp_path: Path) -> None:
    targets = [
        n for n in block_linears(base) if not (n.startswith("single_transformer_blocks.") and n.endswith(LINEAR1_PARTS))
    ]
    peft_model = with_lora(base, targets)
    state = peft_state_to_diffusers(get_peft_model_state_dict(peft_model))
    kohya = diffusers_to_kohya(state, ALPHA, RANK)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in kohya
    assert kohya["lora_unet_double_blocks_1_txt_attn_qkv.alpha"].item() == 3 * ALPHA
    path = save_lora(tmp_path / "kohya.safetensors", kohya, {"format": "pt"}, torch.float32)

    loaded, converted, messages = load_with_diffusers(base, path)

    assert messages == []
    # every converted key reached the transformer: none lacks the prefix the loader filters on
    assert all(k.startswith("transformer.") for k in converted)
    assert lora_modules(loaded) == lora_modules(peft_model) == set(targets)
    torch.testing.assert_close(output(loaded), output(peft_model), atol=1e-5, rtol=1e-5)


def test_full_size_single_block_linear1_split_by_diffusers() -> None:
    """diffusers splits linear1 with FLUX.1's real row counts: check our fusion at that size."""
    gen = torch.Generator().manual_seed(3)
    dims = {"attn.to_q": 3072, "attn.to_k": 3072, "attn.to_v": 3072, "proj_mlp": 12288}
    state = {}
    for module, out in dims.items():
        key = f"transformer.single_transformer_blocks.5.{module}"
        state[f"{key}.lora_A.weight"] = torch.randn(RANK, 3072, generator=gen)
        state[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=gen)
    kohya = diffusers_to_kohya(state, ALPHA, RANK)
    assert kohya["lora_unet_single_blocks_5_linear1.lora_up.weight"].shape == (21504, 4 * RANK)

    converted = _convert_kohya_flux_lora_to_diffusers(dict(kohya))

    assert converted.keys() == state.keys()
    probe = torch.randn(3072, 3, generator=gen)  # compare deltas through a probe: no 21504x3072 matrices
    for key in dims:
        k = f"transformer.single_transformer_blocks.5.{key}"
        ours = state[f"{k}.lora_B.weight"] @ (state[f"{k}.lora_A.weight"] @ probe) * (ALPHA / RANK)
        theirs = converted[f"{k}.lora_B.weight"] @ (converted[f"{k}.lora_A.weight"] @ probe)  # alpha baked in
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-5)


def test_non_block_layers_read_by_diffusers_converter(base: FluxTransformer2DModel) -> None:
    """img_in, txt_in, time/guidance/vector embedders and the final layer (scale/shift swap)."""
    outside = [n for n in linear_names(base) if n not in block_linears(base)]
    assert len(outside) == 10
    pairs = pairs_of(with_lora(base, outside))
    state = {}
    for module, pair in pairs.items():
        state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = pair.down, pair.up
    kohya = diffusers_to_kohya(state, ALPHA, RANK)
    assert "lora_unet_final_layer_adaLN_modulation_1.lora_up.weight" in kohya

    converted = _convert_kohya_flux_lora_to_diffusers(dict(kohya))

    # diffusers names these without the "transformer." prefix (its loader then skips them), so
    # only the converter is checked here; alpha is baked in (scale 1) by diffusers and by us.
    theirs = group_modules({"transformer." + k.removeprefix("transformer."): v for k, v in converted.items()}, RANK)
    assert_same_deltas(theirs, pairs)


def test_kohya_round_trip_all_layers(base: FluxTransformer2DModel, tmp_path: Path) -> None:
    peft_model = with_lora(base, linear_names(base))
    pairs = pairs_of(peft_model)
    state = peft_state_to_diffusers(get_peft_model_state_dict(peft_model))
    path = save_lora(tmp_path / "k.safetensors", diffusers_to_kohya(state, ALPHA, RANK), {}, torch.float32)

    tensors, alphas = kohya_to_diffusers(load_lora_file(path)[0])

    assert_same_deltas(group_modules(tensors, alphas), pairs)
    # block-diagonal fused modules split back into the original rank and alpha
    assert alphas["transformer.transformer_blocks.0.attn.to_q"] == ALPHA
    assert tensors["transformer.single_transformer_blocks.1.proj_mlp.lora_A.weight"].shape[0] == RANK


def test_partially_trained_fused_module_is_padded_and_recovered(base: FluxTransformer2DModel) -> None:
    targets = ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v"]
    peft_model = with_lora(base, targets)
    pairs = pairs_of(peft_model)
    state = peft_state_to_diffusers(get_peft_model_state_dict(peft_model))
    kohya = diffusers_to_kohya(state, ALPHA, RANK)
    assert kohya["lora_unet_single_blocks_0_linear1.lora_up.weight"].shape == (32 * 7, 4 * RANK)

    tensors, alphas = kohya_to_diffusers(kohya)
    assert_same_deltas(group_modules(tensors, alphas), pairs)

    converted = _convert_kohya_flux_lora_to_diffusers(
        {k: v for k, v in kohya.items() if "linear1" not in k}
    )  # the zero-padded k and v come back as zero LoRAs
    torch.testing.assert_close(
        converted["transformer.transformer_blocks.0.attn.to_q.lora_B.weight"]
        @ converted["transformer.transformer_blocks.0.attn.to_q.lora_A.weight"],
        pairs["transformer.transformer_blocks.0.attn.to_q"].delta(),
    )
    assert not converted["transformer.transformer_blocks.0.attn.to_k.lora_B.weight"].any()


def test_dense_fused_lora_splits_exactly() -> None:
    """A fused LoRA trained as one module (not block-diagonal) splits with a shared down."""
    gen = torch.Generator().manual_seed(4)
    fused = LoraPair(torch.randn(6, 8, generator=gen), torch.randn(24, 6, generator=gen), 3.0)
    parts = split_fused_lora(fused, [8, 8, 8])
    assert all(p.rank == 6 and p.alpha == 3.0 for p in parts)
    torch.testing.assert_close(torch.cat([p.delta() for p in parts]), fused.delta())


def test_fuse_then_split_is_identity() -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [LoraPair(torch.randn(2, 8, generator=gen), torch.randn(o, 2, generator=gen), 5.0) for o in (8, 8, 32)]
    fused = fuse_loras(parts)
    assert fused.alpha == 15.0 and fused.rank == 6
    torch.testing.assert_close(fused.delta(), torch.cat([p.delta() for p in parts]))
    for a, b in zip(split_fused_lora(fused, [8, 8, 32]), parts):
        assert torch.equal(a.down, b.down) and torch.equal(a.up, b.up) and a.alpha == b.alpha
