"""kohya LoRA layout for SD 1.5 (`lora_unet_<diffusers module>`, `lora_te_`), checked against
diffusers' own readers, and the other trainers' layouts `--init-lora` reads.

The tiny SD 1.5 UNet and CLIP get peft LoRAs (alpha != rank, random nonzero up factors) on
every linear and conv layer; the kohya file is loaded by StableDiffusionPipeline's loader into
fresh copies and must give the same outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_lora_to_diffusers
from diffusers.utils import convert_unet_state_dict_to_peft

from difftune import families
from difftune.adapters.formats import save_lora
from difftune.config import ModelConfig
from difftune.errors import CheckpointError
from difftune.families.sd15 import keys
from difftune.families.sd15.tiny import build_tiny_sd15
from difftune.precision.policy import PrecisionPolicy

from .conftest import lora_modules, problems
from .sd_lora_helpers import ALPHA, RANK, copy_of, diffusers_state, layer_names, with_lora
from .test_sd15 import RELEASED_UNET

PARTS = build_tiny_sd15()
MAKERS = {"unet": lambda: build_tiny_sd15()["unet"],
          "text_encoder": lambda: build_tiny_sd15()["text_encoder"]}


@pytest.fixture(scope="module")
def base() -> dict[str, torch.nn.Module]:
    return {name: PARTS[name] for name in MAKERS}


@pytest.fixture(scope="module")
def adapted(base: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """LoRA on every linear and conv layer of the UNet, every linear layer of CLIP-L."""
    targets = {"unet": layer_names(base["unet"]),
               "text_encoder": layer_names(base["text_encoder"], torch.nn.Linear)}
    return {n: with_lora(base[n], targets[n], MAKERS[n], seed=i + 5)
            for i, n in enumerate(MAKERS)}


@torch.no_grad()
def outputs(models: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (1, 7), generator=gen)
    width = models["unet"].config.cross_attention_dim
    return {"unet": models["unet"](torch.randn(1, 4, 8, 8, generator=gen), torch.tensor([500]),
                                   torch.randn(1, 7, width, generator=gen)).sample,
            "text_encoder": models["text_encoder"](ids).last_hidden_state}


def _state(adapted: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v for n, m in adapted.items() for k, v in diffusers_state(m, n).items()}


def test_kohya_file_loads_in_diffusers(base, adapted, tmp_path: Path) -> None:
    kohya = keys.diffusers_to_kohya(_state(adapted), ALPHA, RANK)
    for key in ("lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight",
                "lora_unet_down_blocks_0_attentions_1_proj_in.alpha",
                "lora_unet_mid_block_resnets_0_conv1.lora_up.weight",
                "lora_unet_up_blocks_0_upsamplers_0_conv.lora_down.weight",
                "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight",
                "lora_te_text_model_encoder_layers_1_mlp_fc2.alpha"):
        assert key in kohya, key
    path = save_lora(tmp_path / "sd15_kohya.safetensors", kohya, {"format": "pt"}, torch.float32)
    fresh = {name: copy_of(model, MAKERS[name]) for name, model in base.items()}
    with problems() as messages:
        converted, alphas = StableDiffusionPipeline.lora_state_dict(str(path))
        StableDiffusionPipeline.load_lora_into_unet(dict(converted), alphas, fresh["unet"])
        StableDiffusionPipeline.load_lora_into_text_encoder(dict(converted), alphas,
                                                            fresh["text_encoder"])
    assert messages == []
    expected, before, got = outputs(adapted), outputs(base), outputs(fresh)
    for name in MAKERS:
        assert lora_modules(fresh[name]) == lora_modules(adapted[name]), name
        assert (expected[name] - before[name]).abs().max() > 1e-3, name
        torch.testing.assert_close(got[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)


def _family() -> tuple[Any, Any]:
    family = families.get("sd15")
    policy = PrecisionPolicy(torch.device("cpu"), None, torch.float32, torch.float32,
                             torch.float32)
    return family, family.load(ModelConfig(family="sd15", flavor="tiny"), policy)


def _other_trainers(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The same LoRA as other tools write it: kohya/OneTrainer/ai-toolkit `lora_unet_`/`lora_te_`
    with alphas (ai-toolkit and OneTrainer save SD 1.5 in kohya's names), and diffusers/PEFT
    names (`unet.`/`text_encoder.`, alpha = rank)."""
    return {"kohya": keys.diffusers_to_kohya(state, float(RANK), RANK), "diffusers": dict(state)}


@pytest.mark.parametrize("layout", ["kohya", "diffusers"])
def test_init_lora_reads_other_trainers_names(adapted, layout: str) -> None:
    state = _state(adapted)
    family, comps = _family()
    tensors, alphas = family.lora_from_format(comps, _other_trainers(state)[layout])
    # back in the loaded models' own names (transformers 5's CLIP has no text_model. root)
    assert tensors.keys() == state.keys()
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    assert all(a == RANK for a in alphas.values())


def test_full_size_names_read_back_by_diffusers() -> None:
    """Every linear/conv layer of the real-size SD 1.5 UNet (meta device, no weights) gets a
    kohya name diffusers' kohya reader turns back into it."""
    with torch.device("meta"):
        unet = UNet2DConditionModel(**RELEASED_UNET)
    modules = layer_names(unet)
    state = {f"unet.{m}.lora_{x}.weight": torch.zeros(1, 1) for m in modules for x in "AB"}
    converted, alphas = _convert_non_diffusers_lora_to_diffusers(
        keys.diffusers_to_kohya(state, 1.0, 1))
    peft_named = convert_unet_state_dict_to_peft(
        {k.removeprefix("unet."): v for k, v in converted.items()})
    assert {k.rsplit(".", 2)[0] for k in peft_named} == set(modules)
    assert len(alphas) == len(modules)


def test_unknown_names_are_errors(base) -> None:
    modules = [n for n, _ in base["unet"].named_modules()]
    kohya = lambda n: {f"{n}.lora_down.weight": torch.zeros(RANK, 8),  # noqa: E731
                       f"{n}.lora_up.weight": torch.zeros(8, RANK)}
    for name in ("lora_unet_down_blocks_9_attentions_0_proj_in",
                 "lora_te_text_model_embeddings_position_embedding",
                 "lora_te2_text_model_encoder_layers_0_mlp_fc1"):
        with pytest.raises(CheckpointError, match=name.removeprefix("lora_")):
            keys.kohya_to_diffusers(kohya(name), modules)
