"""kohya / ComfyUI LoRA layout for SDXL, checked against diffusers' own readers.

A tiny UNet with SDXL's structure and two tiny CLIP text encoders get peft LoRAs (alpha !=
rank, random nonzero up factors) on every linear and conv layer; the kohya file (SGM names) is
loaded by `StableDiffusionXLPipeline`'s loader into fresh copies and must give the same outputs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionXLPipeline, UNet2DConditionModel
from diffusers.loaders.lora_conversion_utils import (
    _convert_non_diffusers_lora_to_diffusers,
    _maybe_map_sgm_blocks_to_diffusers,
)
from diffusers.utils import convert_unet_state_dict_to_peft
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from difftune.adapters.formats import load_lora_file, save_lora
from difftune.errors import CheckpointError
from difftune.families.sdxl import keys as sdxl_keys
from difftune.families.sdxl.keys import UNetLayout
from difftune.families.common.text import clip_root

from .conftest import lora_modules, problems
from .sd_lora_helpers import ALPHA, RANK, copy_of, diffusers_state, layer_names, seeded, with_lora

UNET_CONFIG = dict(
    block_out_channels=(16, 32),
    layers_per_block=2,
    sample_size=8,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,  # 6 time ids * 8 + 32 pooled text
    cross_attention_dim=32,
    norm_num_groups=8,
)
CLIP_CONFIG = dict(
    bos_token_id=0,
    eos_token_id=2,
    pad_token_id=1,
    hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, vocab_size=100, projection_dim=32
)
# ---------------------------------------------------------------- SDXL models


def make_unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(**UNET_CONFIG)


def make_te1() -> CLIPTextModel:
    return CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))


def make_te2() -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_CONFIG))


@pytest.fixture(scope="module")
def sdxl() -> dict[str, torch.nn.Module]:
    """Seeded tiny base UNet and text encoders."""
    return {"unet": seeded(make_unet, 0), "text_encoder": seeded(make_te1, 1), "text_encoder_2": seeded(make_te2, 2)}


MAKERS = {"unet": make_unet, "text_encoder": make_te1, "text_encoder_2": make_te2}


@torch.no_grad()
def sdxl_outputs(models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Each model's output on fixed inputs."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (1, 7), generator=gen)
    unet_out = models["unet"](
        torch.randn(1, 4, 8, 8, generator=gen),
        torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=gen),
        added_cond_kwargs={"text_embeds": torch.randn(1, 32, generator=gen), "time_ids": torch.rand(1, 6, generator=gen)},
    ).sample
    te2 = models["text_encoder_2"](ids)
    return {
        "unet": unet_out,
        "text_encoder": models["text_encoder"](ids).last_hidden_state,
        "text_encoder_2": torch.cat([te2.last_hidden_state.flatten(), te2.text_embeds.flatten()]),
    }


def sdxl_targets(models: dict[str, torch.nn.Module]) -> dict[str, list[str]]:
    """Every linear and conv layer of the UNet; every linear layer of both CLIP encoders."""
    return {
        "unet": layer_names(models["unet"]),
        "text_encoder": layer_names(models["text_encoder"], torch.nn.Linear),
        "text_encoder_2": layer_names(models["text_encoder_2"], torch.nn.Linear),
    }


@pytest.fixture(scope="module")
def sdxl_lora(sdxl: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """The peft-adapted copies of the three SDXL models."""
    targets = sdxl_targets(sdxl)
    return {name: with_lora(sdxl[name], targets[name], MAKERS[name], seed=i + 5) for i, name in enumerate(sdxl)}


def sdxl_state(peft_models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The combined diffusers LoRA dict of the UNet and both text encoders."""
    state: dict[str, torch.Tensor] = {}
    for name, model in peft_models.items():
        state.update(diffusers_state(model, name))
    return state


# ---------------------------------------------------------------- SDXL tests


def test_sdxl_kohya_file_loads_in_diffusers(sdxl, sdxl_lora, tmp_path: Path) -> None:
    state = sdxl_state(sdxl_lora)
    kohya = sdxl_keys.diffusers_to_kohya(state, ALPHA, RANK, sdxl["unet"].config)
    for key in (
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight",
        "lora_unet_input_blocks_5_1_transformer_blocks_1_ff_net_0_proj.lora_up.weight",
        "lora_unet_middle_block_1_proj_in.alpha",
        "lora_unet_output_blocks_2_2_conv.lora_down.weight",
        "lora_unet_input_blocks_3_0_op.lora_down.weight",
        "lora_unet_output_blocks_3_0_skip_connection.lora_up.weight",
        "lora_unet_label_emb_0_2.lora_up.weight",
        "lora_te1_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
        "lora_te2_text_model_encoder_layers_1_mlp_fc2.alpha",
    ):
        assert key in kohya, key
    assert kohya["lora_unet_input_blocks_1_0_in_layers_2.lora_down.weight"].shape == (RANK, 16, 3, 3)
    path = save_lora(tmp_path / "sdxl_kohya.safetensors", kohya, {"format": "pt"}, torch.float32)

    fresh = {name: copy_of(model, MAKERS[name]) for name, model in sdxl.items()}
    with problems() as messages:
        converted, alphas = StableDiffusionXLPipeline.lora_state_dict(str(path), unet_config=fresh["unet"].config)
        StableDiffusionXLPipeline.load_lora_into_unet(dict(converted), alphas, fresh["unet"])
        for name in ("text_encoder", "text_encoder_2"):
            StableDiffusionXLPipeline.load_lora_into_text_encoder(dict(converted), alphas, fresh[name], prefix=name)

    assert messages == []
    assert len(converted) == len([k for k in kohya if not k.endswith(".alpha")])
    expected, base = sdxl_outputs(sdxl_lora), sdxl_outputs(sdxl)
    got = sdxl_outputs(fresh)
    for name in sdxl:
        assert lora_modules(fresh[name]) == lora_modules(sdxl_lora[name]), name
        assert (expected[name] - base[name]).abs().max() > 1e-3, name  # the LoRA really changes it
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def test_sdxl_round_trip_is_exact(sdxl, sdxl_lora, tmp_path: Path) -> None:
    state = sdxl_state(sdxl_lora)
    layout = UNetLayout.from_config(sdxl["unet"].config)
    alphas_in = {k.rsplit(".", 2)[0]: ALPHA + (i % 3) for i, k in enumerate(sorted(state))}  # per-module alphas
    path = save_lora(tmp_path / "k.safetensors", sdxl_keys.diffusers_to_kohya(state, alphas_in, RANK, layout), {})

    roots = {name: clip_root(sdxl[name]) for name in ("text_encoder", "text_encoder_2")}
    tensors, alphas = sdxl_keys.kohya_to_diffusers(load_lora_file(path)[0], layout, roots)

    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    assert alphas == alphas_in


def test_full_size_sdxl_layout() -> None:
    """SGM numbers of the real SDXL UNet (3 down blocks), derived from its config alone."""
    layout = UNetLayout.from_config(
        {
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            "layers_per_block": 2,
            "mid_block_type": "UNetMidBlock2DCrossAttn",
        }
    )
    expected = {
        "down_blocks.0.resnets.1.conv2": "input_blocks.2.0.out_layers.3",
        "down_blocks.1.downsamplers.0.conv": "input_blocks.6.0.op",
        "down_blocks.2.attentions.1.transformer_blocks.9.attn2.to_k": "input_blocks.8.1.transformer_blocks.9.attn2.to_k",
        "mid_block.resnets.1.time_emb_proj": "middle_block.2.emb_layers.1",
        "up_blocks.0.attentions.2.proj_out": "output_blocks.2.1.proj_out",
        "up_blocks.1.upsamplers.0.conv": "output_blocks.5.2.conv",
        "up_blocks.2.resnets.2.conv_shortcut": "output_blocks.8.0.skip_connection",
    }
    for module, sgm in expected.items():
        assert layout.to_sgm(module) == sgm
        assert layout.from_kohya(sgm.replace(".", "_")) == module


def test_full_size_sdxl_names_read_back_by_diffusers() -> None:
    """All 794 linear/conv layers of the real-size SDXL UNet (built on the meta device, no weights)
    get kohya names that diffusers' own SGM remapper and kohya reader turn back into them."""
    config = dict(
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        block_out_channels=[320, 640, 1280],
        attention_head_dim=[5, 10, 20],
        transformer_layers_per_block=[1, 2, 10],
        cross_attention_dim=2048,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,
    )
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
    modules = layer_names(unet)
    assert len(modules) == 794
    state = {f"unet.{m}.lora_{x}.weight": torch.zeros(1, 1) for m in modules for x in "AB"}
    kohya = sdxl_keys.diffusers_to_kohya(state, 1.0, 1, unet.config)

    converted, alphas = _convert_non_diffusers_lora_to_diffusers(_maybe_map_sgm_blocks_to_diffusers(kohya, unet.config))
    peft_named = convert_unet_state_dict_to_peft({k.removeprefix("unet."): v for k, v in converted.items()})

    assert {k.rsplit(".", 2)[0] for k in peft_named} == set(modules)
    assert len(alphas) == len(modules)


def test_sdxl_unmapped_modules_are_errors(sdxl) -> None:
    config = sdxl["unet"].config
    lora = lambda m: {f"{m}.lora_A.weight": torch.zeros(RANK, 8), f"{m}.lora_B.weight": torch.zeros(8, RANK)}
    for module in (
        "unet.down_blocks.0.resnets.0.norm1",
        "unet.down_blocks.1.attentions.0.transformer_blocks.0.norm1",
        "text_encoder.text_model.embeddings.token_embedding",
        "vae.decoder.conv_in",
    ):
        with pytest.raises(CheckpointError, match=module.split(".", 1)[1].replace(".", r"\.")):
            sdxl_keys.diffusers_to_kohya(lora(module), ALPHA, RANK, config)
    kohya = lambda n: {f"{n}.lora_down.weight": torch.zeros(RANK, 8), f"{n}.lora_up.weight": torch.zeros(8, RANK)}
    for name in (
        "lora_unet_input_blocks_4_1_norm",
        "lora_unet_input_blocks_9_1_proj_in",  # no such block in the tiny UNet
        "lora_te1_text_model_embeddings_position_embedding",
        "lora_te3_text_model_encoder_layers_0_mlp_fc1",
    ):
        with pytest.raises(CheckpointError, match=name.removeprefix("lora_")):
            sdxl_keys.kohya_to_diffusers(kohya(name), config)
    with pytest.raises(CheckpointError, match="rank"):
        sdxl_keys.diffusers_to_kohya(lora("unet.conv_in"), ALPHA, RANK + 1, config)
