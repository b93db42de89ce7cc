"""kohya / ComfyUI LoRA layouts for SDXL and SD3, checked against diffusers' own readers.

SDXL: a tiny UNet with SDXL's structure and two tiny CLIP text encoders get peft LoRAs (alpha !=
rank, random nonzero up factors) on every linear and conv layer; the kohya file (SGM names) is
loaded by `StableDiffusionXLPipeline`'s loader into fresh copies and must give the same outputs.

SD3: diffusers has no reader for SD3 kohya LoRAs, so the file is checked by a numeric round trip
and by merging its deltas into an MMDiT-named checkpoint that diffusers' single-file converter
(`convert_sd3_transformer_checkpoint_to_diffusers`) must turn back into the peft deltas.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from diffusers import (
    SD3Transformer2DModel,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.loaders.lora_conversion_utils import (
    _convert_non_diffusers_lora_to_diffusers,
    _maybe_map_sgm_blocks_to_diffusers,
)
from diffusers.loaders.single_file_utils import (
    convert_sd3_transformer_checkpoint_to_diffusers,
)
from diffusers.utils import convert_unet_state_dict_to_peft
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from difftune.adapters.formats import (
    LoraPair,
    group_modules,
    load_lora_file,
    peft_state_to_diffusers,
    save_lora,
)
from difftune.errors import CheckpointError
from difftune.families.common.text import clip_root
from difftune.families.sd3 import keys as sd3_keys
from difftune.families.sdxl import keys as sdxl_keys
from difftune.families.sdxl.keys import UNetLayout

RANK, ALPHA = 4, 6.0
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


# ---------------------------------------------------------------- helpers


def seeded(make, seed: int):
    """Build a model under a fixed seed, in eval mode."""
    torch.manual_seed(seed)
    return make().eval()


def copy_of(model: torch.nn.Module, make) -> torch.nn.Module:
    """A fresh model with `model`'s weights and no adapter."""
    fresh = make().eval()
    fresh.load_state_dict(model.state_dict())
    return fresh


def layer_names(model: torch.nn.Module, kinds=(torch.nn.Linear, torch.nn.Conv2d)) -> list[str]:
    """Names of every module of the given kinds."""
    return sorted(n for n, m in model.named_modules() if isinstance(m, kinds))


def with_lora(model: torch.nn.Module, targets: list[str], make, seed: int = 1) -> torch.nn.Module:
    """A copy of `model` with a peft LoRA (alpha != rank) on exactly `targets`, up factors random."""
    peft_model = copy_of(model, make)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, init_lora_weights=True)
    inject_adapter_in_model(config, peft_model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return peft_model


def lora_modules(model: torch.nn.Module) -> set[str]:
    """Names of the modules that carry a peft LoRA layer."""
    return {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def diffusers_state(model: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """The model's LoRA named as diffusers saves it (`<prefix>.<module>.lora_A.weight`)."""
    return peft_state_to_diffusers(get_peft_model_state_dict(model), prefix)


def delta(down: torch.Tensor, up: torch.Tensor, alpha: float) -> torch.Tensor:
    """The weight change of a linear or conv LoRA, alpha/rank * up @ down, as a 2-D matrix."""
    return (up.flatten(1).float() @ down.flatten(1).float()) * (alpha / down.shape[0])


class _Collect(logging.Handler):
    """Keeps every record at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def problems() -> Iterator[list[str]]:
    """Collect diffusers/peft warnings (logged or warned) raised inside the block."""
    handler = _Collect()
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield handler.messages
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
    ignored = (DeprecationWarning, FutureWarning)
    handler.messages.extend(str(w.message) for w in caught if not issubclass(w.category, ignored))


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


# ---------------------------------------------------------------- SD3


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
