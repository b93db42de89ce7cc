"""SD 1.5's tiny flavor, text conditioning and sizes, checked against diffusers' own code.

The text embeddings must equal StableDiffusionPipeline.encode_prompt's exactly, with and
without clip_skip; the released UNet and CLIP-L configs build on the meta device with their
published parameter counts, and the UNet config derived from the released UNet's tensor shapes
is the released one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

from difftune import families
from difftune.config import ModelConfig
from difftune.families.base import Components
from difftune.families.common.ldm_unet import ldm_unet_config
from difftune.families.common.text import EncodeOptions
from difftune.families.sd15.files import SD15_HEADS, SD15_SAMPLE_SIZE
from difftune.families.sd15.tiny import build_tiny_sd15
from difftune.precision.policy import PrecisionPolicy

from .test_sd_files import to_sgm_unet

PROMPTS = ["a red circle on a blue background", "x"]
# stable-diffusion-v1-5/unet/config.json (the fields that differ from diffusers' defaults
# are all given) and openai/clip-vit-large-patch14's text config.
RELEASED_UNET: dict[str, Any] = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "block_out_channels": [320, 640, 1280, 1280], "attention_head_dim": 8,
    "cross_attention_dim": 768, "norm_num_groups": 32,
}
RELEASED_CLIP_L: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
}


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Components]:
    """The family and its tiny flavor's components, on the CPU in fp32."""
    family = families.get("sd15")
    policy = PrecisionPolicy(torch.device("cpu"), None, torch.float32, torch.float32,
                             torch.float32)
    return family, family.load(ModelConfig(family="sd15", flavor="tiny"), policy)


def test_text_embeddings_equal_encode_prompt(tiny: tuple[Any, Components]) -> None:
    family, c = tiny
    ours = family.encode_text(c, PROMPTS).tensors
    theirs, _ = family.pipeline(c).encode_prompt(PROMPTS, "cpu", 1, False)
    assert set(ours) == {"prompt_embeds"}
    assert torch.equal(ours["prompt_embeds"], theirs)


def _with_text_model(te: CLIPTextModel) -> CLIPTextModelWithProjection:
    """The same CLIP as a class that still has `.text_model` (what diffusers 0.42's
    encode_prompt reaches for with clip_skip; transformers 5's CLIPTextModel lost it), with an
    identity projection: its hidden states are `te`'s."""
    config = te.config
    model = CLIPTextModelWithProjection(CLIPTextConfig(**{**config.to_dict(),
                                                          "projection_dim": config.hidden_size}))
    state = {f"text_model.{k}": v for k, v in te.state_dict().items()}
    state["text_projection.weight"] = torch.eye(config.hidden_size)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.mark.parametrize("skip", [1, 2])
def test_clip_skip_equals_encode_prompt(tiny: tuple[Any, Components], skip: int) -> None:
    """clip_skip reads an earlier hidden state through the final layer norm, exactly as
    StableDiffusionPipeline.encode_prompt(clip_skip=...) does."""
    family, c = tiny
    ours = family.encode_text(c, PROMPTS, EncodeOptions(clip_skip=skip)).tensors["prompt_embeds"]
    pipe = family.pipeline(c)
    with pytest.raises(AttributeError, match="text_model"):  # the diffusers 0.42 break
        pipe.encode_prompt(PROMPTS, "cpu", 1, False, clip_skip=skip)
    pipe.text_encoder = _with_text_model(c.text_encoders["clip_l"])
    theirs, _ = pipe.encode_prompt(PROMPTS, "cpu", 1, False, clip_skip=skip)
    assert torch.equal(ours, theirs)
    assert not torch.allclose(ours, family.encode_text(c, PROMPTS).tensors["prompt_embeds"])


def test_tiny_is_deterministic_and_leaves_the_rng() -> None:
    torch.manual_seed(7)
    a = build_tiny_sd15()
    after = torch.rand(1)
    torch.manual_seed(7)
    b = build_tiny_sd15()
    assert torch.equal(after, torch.rand(1))
    for name in ("unet", "vae", "text_encoder"):
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    assert type(a["scheduler"]).__name__ == "PNDMScheduler"
    assert a["scheduler"].config.prediction_type == "epsilon"


def test_released_sizes_on_the_meta_device() -> None:
    """UNet 859.52M and CLIP-L 123.06M parameters, as the spec's ModelSize says (within 1%)."""
    with torch.device("meta"):
        unet = UNet2DConditionModel(**RELEASED_UNET)
        clip = CLIPTextModel(CLIPTextConfig(**RELEASED_CLIP_L))
    unet_params = sum(p.numel() for p in unet.parameters())
    clip_params = sum(p.numel() for p in clip.parameters())
    assert unet_params == 859_520_964 and clip_params == 123_060_480
    size = families.get("sd15").spec.sizes[0]
    assert abs(size.denoiser * 1e9 / unet_params - 1) < 0.01
    assert abs(size.encoders * 1e9 / clip_params - 1) < 0.01


def _per_level(config: Any) -> dict[str, Any]:
    """A UNet config with lists for tuples and per-level lists for the per-level fields given
    as one int (as diffusers broadcasts them), so equal configs compare equal."""
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()
           if not k.startswith("_")}
    for key in ("attention_head_dim", "transformer_layers_per_block"):
        if isinstance(out[key], int):
            out[key] = [out[key]] * len(out["block_out_channels"])
    return out


def test_config_from_the_released_shapes_is_the_released_config() -> None:
    """The single-file reader's UNet config, derived from the real UNet's LDM tensor shapes
    (meta tensors, no weights), is the released one: 8 heads a level, conv projections."""
    with torch.device("meta"):
        unet = UNet2DConditionModel(**RELEASED_UNET)
    shapes = {k.removeprefix("model.diffusion_model."): v for k, v in to_sgm_unet(unet).items()}
    derived = ldm_unet_config(shapes, SD15_SAMPLE_SIZE, SD15_HEADS)
    with torch.device("meta"):
        rebuilt = UNet2DConditionModel(**derived)
    assert _per_level(rebuilt.config) == _per_level(unet.config)
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == \
        {k: v.shape for k, v in unet.state_dict().items()}
    assert not derived["use_linear_projection"] and derived["attention_head_dim"] == [8] * 4


def test_pipeline_samples_from_precomputed_embeddings(tiny: tuple[Any, Components]) -> None:
    family, c = tiny
    pipe = family.pipeline(c)
    assert isinstance(pipe, StableDiffusionPipeline) and pipe.safety_checker is None
    kwargs = family.pipeline_inputs(family.encode_text(c, PROMPTS[:1]),
                                    family.encode_text(c, [""]), 0.0, 7.5)
    image = pipe(**kwargs, num_inference_steps=2, height=64, width=64, output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images
    assert image.shape == (1, 3, 64, 64) and torch.isfinite(image).all()
