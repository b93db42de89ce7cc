"""kohya / ComfyUI LoRA layout for SD3, checked against diffusers' own converter.

diffusers has no reader for SD3 kohya LoRAs, so the file is checked by a numeric round trip
and by merging its deltas into an MMDiT-named checkpoint that diffusers' single-file converter
(`convert_sd3_transformer_checkpoint_to_diffusers`) must turn back into the peft deltas. Also the
per-family default formats and SD3 variant names.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_sd3_transformer_checkpoint_to_diffusers,
)

from difftune.adapters.formats import (
    LoraPair,
    group_modules,
    load_lora_file,
    save_lora,
)
from difftune.errors import CheckpointError
from difftune.families.sd3 import keys as sd3_keys

from .sd_lora_helpers import (ALPHA, RANK, copy_of, delta, diffusers_state, layer_names, seeded,
                              with_lora)

SD3_CONFIG = dict(
    sample_size=8,
    patch_size=1,
    in_channels=4,
    num_layers=3,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=16,
    caption_projection_dim=16,
    pooled_projection_dim=16,
    out_channels=4,
    dual_attention_layers=(0,),  # SD3.5's second attention on the image stream
    qk_norm="rms_norm",
)


def make_sd3() -> SD3Transformer2DModel:
    return SD3Transformer2DModel(**SD3_CONFIG)


@pytest.fixture(scope="module")
def sd3() -> SD3Transformer2DModel:
    return seeded(make_sd3, 0)


def sd3_targets(model: SD3Transformer2DModel) -> list[str]:
    """Every linear layer (the conv patch embedding has no kohya name)."""
    return layer_names(model, torch.nn.Linear)


def mmdit_name(kohya_name: str) -> str:
    """`joint_blocks_0_x_block_attn2_qkv` -> `joint_blocks.0.x_block.attn2.qkv` (test-side spelling)."""
    dotted = kohya_name.replace("_", ".")
    for word in ("joint_blocks", "x_block", "context_block", "adaLN_modulation", "final_layer",
                 "t_embedder", "y_embedder", "context_embedder"):
        dotted = dotted.replace(word.replace("_", "."), word)
    return dotted


def merged_mmdit_checkpoint(kohya: dict[str, torch.Tensor], model: SD3Transformer2DModel) -> dict[str, torch.Tensor]:
    """An MMDiT-named checkpoint whose weights are the kohya LoRA's deltas (zeros elsewhere)."""
    ckpt: dict[str, torch.Tensor] = {}
    for key, down in kohya.items():
        if key.endswith(".lora_down.weight"):
            base = key.removesuffix(".lora_down.weight")
            w = delta(down, kohya[f"{base}.lora_up.weight"], kohya[f"{base}.alpha"].item())
            name = mmdit_name(base.removeprefix("lora_unet_"))
            ckpt[f"{name}.weight"], ckpt[f"{name}.bias"] = w, torch.zeros(w.shape[0])
    head_dim = SD3_CONFIG["attention_head_dim"]
    for i in range(SD3_CONFIG["num_layers"]):
        streams = ["x_block.attn", "context_block.attn"] + (["x_block.attn2"] if i in SD3_CONFIG["dual_attention_layers"] else [])
        for stream in streams:
            for norm in ("ln_q", "ln_k"):
                ckpt[f"joint_blocks.{i}.{stream}.{norm}.weight"] = torch.ones(head_dim)
    conv = model.pos_embed.proj
    ckpt.update({"pos_embed": torch.zeros(1, 64, 16), "x_embedder.proj.weight": torch.zeros_like(conv.weight),
                 "x_embedder.proj.bias": torch.zeros_like(conv.bias)})
    return ckpt


def test_sd3_kohya_deltas_match_diffusers_single_file_converter(sd3: SD3Transformer2DModel, tmp_path: Path) -> None:
    targets = sd3_targets(sd3)
    peft_model = with_lora(sd3, targets, make_sd3)
    state = diffusers_state(peft_model, "transformer")
    kohya = sd3_keys.diffusers_to_kohya(state, ALPHA, RANK, SD3_CONFIG["num_layers"])
    for key in (
        "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight",
        "lora_unet_joint_blocks_0_x_block_attn2_proj.lora_up.weight",
        "lora_unet_joint_blocks_1_context_block_attn_qkv.alpha",
        "lora_unet_joint_blocks_1_context_block_mlp_fc2.lora_up.weight",
        "lora_unet_joint_blocks_2_context_block_adaLN_modulation_1.lora_up.weight",
        "lora_unet_final_layer_adaLN_modulation_1.lora_up.weight",
        "lora_unet_t_embedder_mlp_0.lora_down.weight",
    ):
        assert key in kohya, key
    assert "lora_unet_joint_blocks_2_context_block_attn_proj.alpha" not in kohya  # pre-only last block
    assert kohya["lora_unet_joint_blocks_0_x_block_attn_qkv.alpha"].item() == 3 * ALPHA
    path = save_lora(tmp_path / "sd3_kohya.safetensors", kohya, {"format": "pt"}, torch.float32)

    converted = convert_sd3_transformer_checkpoint_to_diffusers(merged_mmdit_checkpoint(load_lora_file(path)[0], sd3))

    pairs = group_modules(state, ALPHA)
    assert {f"transformer.{k.removesuffix('.weight')}" for k in converted if k.endswith(".weight")} >= set(pairs)
    for module, pair in pairs.items():
        weight = converted[f"{module.removeprefix('transformer.')}.weight"]
        torch.testing.assert_close(weight, pair.delta(), atol=1e-6, rtol=1e-5, msg=module)

    # and the deltas are the peft model's: merged into the base they give its output
    merged = copy_of(sd3, make_sd3)
    with torch.no_grad():
        params = dict(merged.named_parameters())
        for module, pair in pairs.items():
            params[f"{module.removeprefix('transformer.')}.weight"] += pair.delta()
    torch.testing.assert_close(sd3_output(merged), sd3_output(peft_model), atol=1e-5, rtol=1e-5)
    assert (sd3_output(peft_model) - sd3_output(sd3)).abs().max() > 1e-3


@torch.no_grad()
def sd3_output(model: SD3Transformer2DModel) -> torch.Tensor:
    """The transformer's output on fixed inputs."""
    gen = torch.Generator().manual_seed(4)
    return model(
        hidden_states=torch.randn(1, 4, 8, 8, generator=gen),
        encoder_hidden_states=torch.randn(1, 5, 16, generator=gen),
        pooled_projections=torch.randn(1, 16, generator=gen),
        timestep=torch.tensor([500]),
        return_dict=False,
    )[0]


def test_sd3_round_trip_and_partial_qkv(sd3: SD3Transformer2DModel) -> None:
    targets = sd3_targets(sd3)
    state = diffusers_state(with_lora(sd3, targets, make_sd3, seed=7), "transformer")
    tensors, alphas = sd3_keys.kohya_to_diffusers(sd3_keys.diffusers_to_kohya(state, ALPHA, RANK, 3), 3)
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    assert set(alphas.values()) == {ALPHA}

    partial = {k: v for k, v in state.items() if ".attn.to_k." in k or ".attn.add_v_proj." in k}
    kohya = sd3_keys.diffusers_to_kohya(partial, ALPHA, RANK, 3)
    assert kohya["lora_unet_joint_blocks_1_x_block_attn_qkv.lora_up.weight"].shape == (3 * 16, 3 * RANK)
    tensors, _ = sd3_keys.kohya_to_diffusers(kohya, 3)
    assert tensors.keys() == partial.keys()  # the zero-filled q, v (k, q) parts are dropped again


def test_sd3_dense_fused_kohya_lora_splits_exactly() -> None:
    """A qkv LoRA trained as one module by sd-scripts (shared down) splits into exact parts."""
    gen = torch.Generator().manual_seed(8)
    fused = LoraPair(torch.randn(RANK, 16, generator=gen), torch.randn(48, RANK, generator=gen), ALPHA)
    kohya = {
        "lora_unet_joint_blocks_0_context_block_attn_qkv.lora_down.weight": fused.down,
        "lora_unet_joint_blocks_0_context_block_attn_qkv.lora_up.weight": fused.up,
        "lora_unet_joint_blocks_0_context_block_attn_qkv.alpha": torch.tensor(ALPHA),
    }
    tensors, alphas = sd3_keys.kohya_to_diffusers(kohya, 2)
    pairs = group_modules(tensors, alphas)
    parts = [pairs[f"transformer.transformer_blocks.0.attn.add_{c}_proj"].delta() for c in "qkv"]
    torch.testing.assert_close(torch.cat(parts), fused.delta())


def test_sd3_unmapped_modules_are_errors() -> None:
    lora = lambda m, i=8: {f"{m}.lora_A.weight": torch.zeros(RANK, i), f"{m}.lora_B.weight": torch.zeros(8, RANK)}
    for module in ("transformer.pos_embed.proj", "transformer.transformer_blocks.0.attn.norm_q"):
        with pytest.raises(CheckpointError, match=module.removeprefix("transformer.").replace(".", r"\.")):
            sd3_keys.diffusers_to_kohya(lora(module), ALPHA, RANK, 2)
    with pytest.raises(CheckpointError, match="outside"):
        sd3_keys.diffusers_to_kohya(lora("text_encoder.text_model.encoder.layers.0.mlp.fc1"), ALPHA, RANK, 2)
    kohya = lambda n: {f"{n}.lora_down.weight": torch.zeros(RANK, 8), f"{n}.lora_up.weight": torch.zeros(8, RANK)}
    for name in ("lora_unet_x_embedder_proj", "lora_unet_joint_blocks_0_x_block_attn_bogus"):
        with pytest.raises(CheckpointError, match=name):
            sd3_keys.kohya_to_diffusers(kohya(name), 2)
    with pytest.raises(CheckpointError, match="lora_te1"):
        sd3_keys.kohya_to_diffusers(kohya("lora_te1_text_model_encoder_layers_0_mlp_fc1"), 2)
    with pytest.raises(CheckpointError, match="has 2 blocks"):
        sd3_keys.kohya_to_diffusers(kohya("lora_unet_joint_blocks_2_x_block_mlp_fc1"), 2)


# ---------------------------------------------------------------- defaults and names per family


def test_each_family_declares_the_format_every_reader_reads_fully(tmp_path: Path) -> None:
    """ComfyUI maps no UNet attention key of SDXL's diffusers (PEFT) layout, so SDXL defaults
    to kohya; FLUX.1 and SD3 to diffusers. save.format unset means that default."""
    from difftune import families
    from difftune.config import SaveConfig
    from difftune.train.checkpoint.lora import lora_format

    defaults = {n: families.get(n).default_format for n in ("flux", "sd3", "sdxl")}
    assert defaults == {"flux": "diffusers", "sd3": "diffusers", "sdxl": "kohya"}
    unset, explicit = SaveConfig(dir=tmp_path), SaveConfig(dir=tmp_path, format="diffusers")
    assert unset.format is None
    assert lora_format(unset, families.get("sdxl")) == "kohya"
    assert lora_format(explicit, families.get("sdxl")) == "diffusers"


def test_sd3_variants_are_named_as_kohya_tells_them_apart() -> None:
    """kohya's analyze_state_dict_state (library/sd3_utils.py): no q/k norm is SD3 medium;
    with it, x-block self-attention layers mean SD3.5 medium, none SD3.5 large."""
    assert sd3_keys.variant(None, ()) == "3-medium"
    assert sd3_keys.variant("rms_norm", (0, 1, 2)) == "3-5-medium"
    assert sd3_keys.variant("rms_norm", ()) == "3-5-large"
    assert sd3_keys.VARIANTS["3-5-large"] == "stable-diffusion-3-5-large"
