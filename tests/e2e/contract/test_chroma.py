"""Chroma-only behaviour on the tiny flavor: text conditioning equal to ChromaPipeline's own
`encode_prompt` (T5 mask inside the encoder and the transformer mask with one padding token),
the kohya layout read back to the diffusers deltas, and single-file transformer loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune import families
from difftune.adapters.formats import group_modules
from difftune.errors import CheckpointError
from difftune.config import ModelConfig, PrecisionConfig
from difftune.families.base import Components
from difftune.families.chroma.files import load_transformer_file
from difftune.families.chroma.keys import diffusers_to_kohya, kohya_to_diffusers
from difftune.families.common import text
from difftune.precision.policy import PrecisionPolicy

PROMPTS = ["a red circle", "",
           "a very long prompt about a red circle on a blue background " * 4]


@pytest.fixture(scope="module")
def comps() -> Components:
    """The tiny Chroma components on the CPU, default precision."""
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    return families.get("chroma").load(ModelConfig(family="chroma", flavor="tiny"), policy)


def test_text_conditioning_equals_the_pipelines_encode_prompt(comps: Components) -> None:
    family = families.get("chroma")
    outputs = text.encode_all(family.text_encoders, comps, PROMPTS)  # the cache's encode path
    ours = family.combine_text(comps, outputs).tensors
    pipe = family.pipeline(comps)
    length = text.max_length(family.text_encoders[0], comps.extras)
    embeds, _, mask, *_ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                             max_sequence_length=length)
    assert torch.equal(ours["prompt_embeds"], embeds)
    assert torch.equal(ours["prompt_attention_mask"], mask)
    # The T5 mask is applied inside T5 (a padded prompt differs from the unmasked encoding).
    plain = text.encode(family.text_encoders[0], comps.text_encoders["t5"],
                        comps.tokenizers["t5"], PROMPTS, length, mask=False)["hidden"]
    assert not torch.equal(plain, embeds)
    # Text tokens and exactly one padding token attend.
    tokens = comps.tokenizers["t5"](PROMPTS, padding="max_length", max_length=length,
                                    truncation=True, return_tensors="pt")["attention_mask"]
    assert torch.equal(mask.sum(1), torch.clamp(tokens.sum(1) + 1, max=length).float())


def test_kohya_layout_reads_back_to_the_diffusers_deltas(comps: Components) -> None:
    family = families.get("chroma")
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    modules = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
               "transformer_blocks.1.ff.net.0.proj", "single_transformer_blocks.0.attn.to_v",
               "single_transformer_blocks.1.proj_mlp", "single_transformer_blocks.1.proj_out"]
    named = dict(comps.denoiser.named_modules())
    for m in modules:
        layer = named[m]
        state[f"transformer.{m}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=gen)
        state[f"transformer.{m}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=gen)
    kohya = family.to_kohya(comps, state, rank=4, alpha=8.0)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in kohya
    assert "lora_unet_single_blocks_1_linear1.lora_up.weight" in kohya
    back, alphas = kohya_to_diffusers(kohya)
    ours, theirs = group_modules(state, 8.0), group_modules(back, alphas)
    assert set(ours) == set(theirs)
    for name, pair in ours.items():
        torch.testing.assert_close(theirs[name].delta(), pair.delta())
    assert diffusers_to_kohya(state, alpha=8.0, rank=4).keys() == kohya.keys()


def test_single_file_transformer_loads_as_the_folder(comps: Components, tmp_path: Path) -> None:
    path = tmp_path / "chroma.safetensors"
    reference = comps.denoiser.state_dict()
    save_file({k: v.contiguous() for k, v in reference.items()}, str(path))
    loaded = load_transformer_file(path, torch.float32)
    assert loaded.config.approximator_layers == comps.denoiser.config.approximator_layers
    state = loaded.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in state)


def test_kohya_double_blocks_read_through_diffusers_converter(comps: Components,
                                                              tmp_path: Path) -> None:
    """diffusers' kohya reader (FluxLoraLoaderMixin, as ChromaPipeline uses it) gives back the
    same deltas. Its converter splits single blocks' `linear1` with full-size row counts, so
    only double blocks are checked on the tiny flavor (as for FLUX.1)."""
    from diffusers import ChromaPipeline

    family = families.get("chroma")
    gen = torch.Generator().manual_seed(1)
    named = dict(comps.denoiser.named_modules())
    state: dict[str, torch.Tensor] = {}
    for m in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_k_proj", "ff.net.2"):
        layer = named[f"transformer_blocks.0.{m}"]
        state[f"transformer.transformer_blocks.0.{m}.lora_A.weight"] = torch.randn(
            4, layer.in_features, generator=gen)
        state[f"transformer.transformer_blocks.0.{m}.lora_B.weight"] = torch.randn(
            layer.out_features, 4, generator=gen)
    path = tmp_path / "kohya.safetensors"
    save_file(family.to_kohya(comps, state, rank=4, alpha=4.0), str(path))
    converted = ChromaPipeline.lora_state_dict(str(path))  # raises on any unconsumed key
    theirs, ours = group_modules(converted, 4.0), group_modules(state, 4.0)
    assert set(ours) <= set(theirs)
    for name, pair in theirs.items():
        expected = ours[name].delta() if name in ours else torch.zeros_like(pair.delta())
        torch.testing.assert_close(pair.delta(), expected)


def test_a_t5_lora_is_refused_at_config_load(tmp_path: Path) -> None:
    from difftune.config import load_config
    from difftune.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('[model]\nfamily = "chroma"\nflavor = "tiny"\n[adapter]\n'
                    'text_encoders = ["t5"]\n[[datasets]]\npath = "x"\n[save]\ndir = "out"\n',
                    encoding="utf-8")
    with pytest.raises(ConfigError, match="'t5' of model.family = \"chroma\" cannot get a LoRA"):
        load_config(path)


def test_comfyui_original_names_read_as_the_deltas_they_mean(comps: Components) -> None:
    """`diffusion_model.<original module>` PEFT keys (what ComfyUI's own LoRA training and
    ai-toolkit write for Chroma) read back, through `--init-lora`'s reader, to diffusers
    modules whose deltas are the file's `up @ down * alpha / rank` (alpha = rank when the file
    has none, as ComfyUI reads it): fused qkv rows split into to_q/to_k/to_v in that order."""
    gen = torch.Generator().manual_seed(2)
    named = dict(comps.denoiser.named_modules())
    width = named["transformer_blocks.0.attn.to_q"].in_features
    linear2 = named["single_transformer_blocks.1.proj_out"]
    final = named["proj_out"]
    files = {  # original module: (down, up, alpha or None)
        "double_blocks.0.img_attn.qkv": (torch.randn(4, width, generator=gen),
                                         torch.randn(3 * width, 4, generator=gen), None),
        "single_blocks.1.linear2": (torch.randn(2, linear2.in_features, generator=gen),
                                    torch.randn(linear2.out_features, 2, generator=gen), 1.0),
        "final_layer.linear": (torch.randn(4, final.in_features, generator=gen),
                               torch.randn(final.out_features, 4, generator=gen), None),
    }
    tensors: dict[str, torch.Tensor] = {}
    for module, (down, up, alpha) in files.items():
        tensors[f"diffusion_model.{module}.lora_A.weight"] = down
        tensors[f"diffusion_model.{module}.lora_B.weight"] = up
        if alpha is not None:
            tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(alpha)
    state, alphas = families.get("chroma").lora_from_format(comps, tensors)
    pairs = group_modules(state, alphas)

    def meant(module: str) -> torch.Tensor:
        down, up, alpha = files[module]
        return up @ down * ((alpha if alpha is not None else down.shape[0]) / down.shape[0])

    qkv = torch.cat([pairs[f"transformer.transformer_blocks.0.attn.to_{p}"].delta()
                     for p in "qkv"])
    torch.testing.assert_close(qkv, meant("double_blocks.0.img_attn.qkv"))
    torch.testing.assert_close(pairs["transformer.single_transformer_blocks.1.proj_out"].delta(),
                               meant("single_blocks.1.linear2"))
    torch.testing.assert_close(pairs["transformer.proj_out"].delta(),
                               meant("final_layer.linear"))
    with pytest.raises(CheckpointError, match="diffusion_model.double_blocks.0.nonsense"):
        families.get("chroma").lora_from_format(
            comps, {"diffusion_model.double_blocks.0.nonsense": torch.zeros(1)})
