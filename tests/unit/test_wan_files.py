"""Wan from local files: a diffusers folder in the released layout (the tiny pipeline saved with
save_pretrained; Wan 2.2 A14B's with both experts), and the ComfyUI single files over it (the
transformer in Wan's original names, the VAE in Wan's, UMT5 in transformers' names), each equal
to the tiny model it was written from."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.wan.files import load_wan_files, single_file_layout
from difftune.families.wan.tiny import build_tiny_wan
from difftune.files.single import write_layout

from .conftest import assert_same_weights
from .test_qwen_image_files import to_wan_vae

FP32 = {"transformer": torch.float32, "transformer_2": torch.float32,
        "text_encoders": torch.float32, "vae": torch.float32}
LOW = "2.2-t2v-a14b-low"
BOTH = "2.2-t2v-a14b"


def _randomized(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every weight random (zero-initialized ones would hide a misplaced one)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    from diffusers import WanPipeline

    tiny = build_tiny_wan()
    _randomized(tiny["transformer"])
    folder = tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-1.3B-Diffusers"
    WanPipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    files = folder.parent
    write_layout(files / "wan2.1_t2v_1.3B_bf16.safetensors",
                 single_file_layout(tiny["transformer"]), tiny["transformer"].state_dict(),
                 torch.float32)
    save_file({to_wan_vae(k): v.contiguous() for k, v in tiny["vae"].state_dict().items()},
              str(files / "wan_2.1_vae.safetensors"))
    save_file({k: v.contiguous() for k, v in tiny["text_encoder"].state_dict().items()
               if k != "encoder.embed_tokens.weight"}, str(files / "umt5_xxl_fp16.safetensors"))
    return tiny, folder


def test_diffusers_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    parts = load_wan_files(ModelConfig(family="wan", path=folder), FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    assert type(parts["scheduler"]).__name__ == "UniPCMultistepScheduler"
    assert parts["scheduler"].config.flow_shift == 3.0


def test_single_files_over_the_folder(saved: tuple[dict, Path]) -> None:
    tiny, folder = saved
    keys = load_file(str(folder.parent / "wan2.1_t2v_1.3B_bf16.safetensors")).keys()
    assert {"blocks.0.self_attn.q.weight", "blocks.1.cross_attn.norm_k.weight",
            "blocks.0.norm3.weight", "blocks.0.modulation", "head.modulation",
            "time_projection.1.weight", "text_embedding.2.weight"} <= set(keys)
    cfg = ModelConfig(family="wan", path=folder,
                      transformer=folder.parent / "wan2.1_t2v_1.3B_bf16.safetensors",
                      vae=folder.parent / "wan_2.1_vae.safetensors",
                      text_encoder=folder.parent / "umt5_xxl_fp16.safetensors")
    parts = load_wan_files(cfg, FP32)
    for name in ("transformer", "vae", "text_encoder"):
        assert_same_weights(parts[name], tiny[name])
    public = lambda c: {k: v for k, v in c.items() if not k.startswith("_")}  # noqa: E731
    assert public(parts["transformer"].config) == public(tiny["transformer"].config)
    assert type(parts["text_encoder"]).__name__ == "UMT5EncoderModel"


@pytest.fixture(scope="module")
def a14b(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A Wan 2.2 A14B folder: the high-noise expert in transformer/, the low in transformer_2/."""
    from diffusers import WanPipeline

    tiny = build_tiny_wan(LOW)
    high = build_tiny_wan("2.1-t2v-14b")["transformer"]
    folder = tmp_path_factory.mktemp("a14b") / "Wan2.2-T2V-A14B-Diffusers"
    WanPipeline(**{**tiny, "transformer": high}, boundary_ratio=0.875).save_pretrained(
        str(folder), safe_serialization=True)
    return {**tiny, "high": high}, folder


def test_a14b_folder_trains_its_low_noise_expert(a14b: tuple[dict, Path]) -> None:
    tiny, folder = a14b
    parts = load_wan_files(ModelConfig(family="wan", variant=LOW, path=folder), FP32)
    assert_same_weights(parts["transformer_2"], tiny["transformer_2"])
    assert "transformer" not in parts


def test_a14b_folder_as_wan21_is_refused_naming_the_variant(a14b: tuple[dict, Path]) -> None:
    _, folder = a14b
    with pytest.raises(ModelFileError,
                       match=f'two experts.*model.variant = "{BOTH}".*"{LOW}"'):
        load_wan_files(ModelConfig(family="wan", path=folder), FP32)


def test_a14b_folder_and_comfyui_files_give_both_experts(a14b: tuple[dict, Path]) -> None:
    """The two-expert variant reads transformer/ (high noise) and transformer_2/ (low) from
    the released folder, or each from its ComfyUI single file (Wan's names) over it."""
    tiny, folder = a14b
    parts = load_wan_files(ModelConfig(family="wan", variant=BOTH, path=folder), FP32)
    assert_same_weights(parts["transformer"], tiny["high"])
    assert_same_weights(parts["transformer_2"], tiny["transformer_2"])
    files = {}
    for part, name, model in (("transformer", "high", tiny["high"]),
                              ("transformer_2", "low", tiny["transformer_2"])):
        files[part] = folder.parent / f"wan2.2_t2v_{name}_noise_14B_fp16.safetensors"
        write_layout(files[part], single_file_layout(model), model.state_dict(), torch.float32)
    parts = load_wan_files(ModelConfig(family="wan", variant=BOTH, path=folder, **files), FP32)
    assert_same_weights(parts["transformer"], tiny["high"])
    assert_same_weights(parts["transformer_2"], tiny["transformer_2"])


def test_an_image_to_video_transformer_is_refused(saved: tuple[dict, Path],
                                                  tmp_path: Path) -> None:
    from diffusers import WanTransformer3DModel

    from difftune.families.wan.tiny import TINY_TRANSFORMER_CONFIG

    _, folder = saved
    i2v = WanTransformer3DModel(**{**TINY_TRANSFORMER_CONFIG, "image_dim": 8,
                                   "added_kv_proj_dim": 24})
    path = tmp_path / "wan2.1_i2v_480p_14B_bf16.safetensors"
    save_file({k: v.contiguous() for k, v in i2v.state_dict().items()}, str(path))
    with pytest.raises(ModelFileError, match='2.1 image-to-video transformer; set '
                       'model.variant = "2.1-i2v-14b"'):
        load_wan_files(ModelConfig(family="wan", path=folder, transformer=path), FP32)


def test_layout_places_every_tensor_once() -> None:
    model = build_tiny_wan()["transformer"]
    layout = single_file_layout(SimpleNamespace(**{"state_dict": model.state_dict}))
    assert sorted(s for p in layout.values() for s in p.sources) == sorted(model.state_dict())


def test_i2v_folder_gives_both_experts_and_each_task_refuses_the_others_files(
        saved: tuple[dict, Path], tmp_path: Path) -> None:
    """A WanImageToVideoPipeline folder of the I2V A14B pair loads as the "2.2-i2v-a14b"
    variant; its 36-channel expert file on a text-to-video variant, and a T2V file on the
    I2V variant, are refused naming the variant."""
    from diffusers import WanImageToVideoPipeline

    tiny = build_tiny_wan("2.2-i2v-a14b")
    folder = tmp_path / "Wan2.2-I2V-A14B-Diffusers"
    WanImageToVideoPipeline(**tiny).save_pretrained(
        str(folder), safe_serialization=True)
    parts = load_wan_files(ModelConfig(family="wan", variant="2.2-i2v-a14b", path=folder), FP32)
    for part in ("transformer", "transformer_2"):
        assert_same_weights(parts[part], tiny[part])
    high = tmp_path / "wan2.2_i2v_high_noise_14B_fp16.safetensors"
    write_layout(high, single_file_layout(tiny["transformer"]),
                 tiny["transformer"].state_dict(), torch.float32)
    with pytest.raises(ModelFileError, match=r'image-to-video transformer \(36 input channels'
                       r'\).*"2.1-t2v-1.3b" is text-to-video; set model.variant = "2.2-i2v'):
        load_wan_files(ModelConfig(family="wan", path=saved[1], transformer=high), FP32)
    t2v = saved[1].parent / "wan2.1_t2v_1.3B_bf16.safetensors"
    with pytest.raises(ModelFileError, match=r"text-to-video transformer \(16 input channels"):
        load_wan_files(ModelConfig(family="wan", variant="2.2-i2v-a14b", path=folder,
                                   transformer=t2v), FP32)


@pytest.mark.full_only  # the I2V A14B folder's case above covers the folder path by default
def test_wan21_i2v_folder_and_single_file_give_the_transformer_and_clip_encoder(
        tmp_path: Path) -> None:
    """A Wan 2.1 I2V folder gives the transformer (its image embedder and image
    cross-attention) and the CLIP vision encoder and processor as saved, whose files are part
    of the fingerprint; ComfyUI's single transformer file (Wan's names) over it is read with
    its image embedder's width."""
    import os

    from diffusers import WanImageToVideoPipeline

    tiny = build_tiny_wan("2.1-i2v-14b")
    _randomized(tiny["transformer"])
    folder = tmp_path / "Wan2.1-I2V-14B-480P-Diffusers"
    WanImageToVideoPipeline(**tiny).save_pretrained(str(folder), safe_serialization=True)
    cfg = ModelConfig(family="wan", variant="2.1-i2v-14b", path=folder)
    parts = load_wan_files(cfg, FP32)
    for name in ("transformer", "image_encoder", "vae"):
        assert_same_weights(parts[name], tiny[name])
    assert parts["image_processor"].crop_size == {"height": 32, "width": 32}
    weights = next((folder / "image_encoder").glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert load_wan_files(cfg, FP32)["fingerprint"] != parts["fingerprint"]
    single = tmp_path / "wan2.1_i2v_480p_14B_bf16.safetensors"
    write_layout(single, single_file_layout(tiny["transformer"]),
                 tiny["transformer"].state_dict(), torch.float32)
    assert "img_emb.proj.1.weight" in load_file(str(single))
    clip = tmp_path / "clip_vision_h.safetensors"  # ComfyUI's CLIP vision file over the folder's
    save_file({k: v.contiguous() for k, v in _comfy_clip_vision(tiny["image_encoder"],
                                                                "transformers").items()},
              str(clip))
    over = load_wan_files(ModelConfig(family="wan", variant="2.1-i2v-14b", path=folder,
                                      transformer=single, image_encoder=clip), FP32)
    assert_same_weights(over["transformer"], tiny["transformer"])
    assert_same_weights(over["image_encoder"], tiny["image_encoder"])
    assert over["fingerprint"] != parts["fingerprint"]


def _comfy_clip_vision(encoder: torch.nn.Module, naming: str) -> dict[str, torch.Tensor]:
    """The tiny CLIP vision encoder's tensors as ComfyUI's clip_vision_h.safetensors holds
    them: transformers' names under `vision_model.` with the projection (the file as ComfyUI
    distributes it), or open_clip's under `visual.` (q, k, v stacked in `attn.in_proj_*`)."""
    from difftune.families.wan.clip_vision import OPEN_CLIP_BLOCK, OPEN_CLIP_TOP

    sd = {k: v.clone() for k, v in encoder.state_dict().items()}
    width = sd["embeddings.class_embedding"].shape[0]
    if naming == "transformers":
        return {**{f"vision_model.{k}": v for k, v in sd.items()},
                "visual_projection.weight": torch.randn(32, width)}
    out = {f"visual.{ours}": sd.pop(theirs) for ours, theirs in OPEN_CLIP_TOP.items()}
    for n in range(encoder.config.num_hidden_layers):
        block = f"encoder.layers.{n}."
        for kind in ("weight", "bias"):
            out[f"visual.transformer.resblocks.{n}.attn.in_proj_{kind}"] = torch.cat(
                [sd.pop(f"{block}self_attn.{p}_proj.{kind}") for p in "qkv"])
            for ours, theirs in OPEN_CLIP_BLOCK.items():
                out[f"visual.transformer.resblocks.{n}.{ours}.{kind}"] = sd.pop(
                    f"{block}{theirs}.{kind}")
    assert not sd, sd  # every tensor written once
    return {**out, "visual.proj": torch.randn(width, 32)}


@pytest.mark.parametrize("naming", ["transformers", "open_clip"])
def test_comfyui_clip_vision_file_loads_bit_for_bit(tmp_path: Path, naming: str) -> None:
    """ComfyUI's clip_vision_h.safetensors (either naming its loader reads) gives the tiny
    CLIP vision encoder it was written from: every weight, and the penultimate hidden states
    the pipeline reads, equal bit for bit (the projection, which it does not read, left out)."""
    from difftune.families.wan.clip_vision import load_file
    from difftune.families.wan.tiny import _image_encoder

    tiny = _randomized(_image_encoder("2.1-i2v-14b")["image_encoder"])
    path = tmp_path / "clip_vision_h.safetensors"
    save_file({k: v.contiguous() for k, v in _comfy_clip_vision(tiny, naming).items()},
              str(path))
    loaded = load_file(path, torch.float32)
    assert_same_weights(loaded, tiny)
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "patch_size", "image_size", "hidden_act")
    assert [getattr(loaded.config, k) for k in sizes] == [getattr(tiny.config, k) for k in sizes]
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = tiny(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        got = loaded(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    assert torch.equal(got, want)
