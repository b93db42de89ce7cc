"""SD 1.5 from local files (difftune.families.sd15.files): the original single checkpoint
(v1-5-pruned-emaonly.safetensors layout) and the diffusers folder.

The tiny model is written in the original layout by the test-only inverse mappings of
test_sd_files (written independently of diffusers' converters), read back by our loader, and
must compute what the original computes; the UNet is also compared with diffusers' own
`from_single_file`, an independent reader of the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import save_file

from difftune import families
from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.common.tiny import CLIP_L_WIDTH, clip_encoder
from difftune.families.sd15.files import load_sd15_file, load_sd15_folder, single_file_layout
from difftune.families.sd15.tiny import TINY_SD15_UNET_CONFIG, build_tiny_sd15
from difftune.precision.policy import PrecisionPolicy

from .layouts import to_ldm_vae
from .test_sd_files import F32, _cfg, _hf_clip, _same_text, _tokenizer_folder, to_sgm_unet


def _original(parts: dict) -> dict[str, torch.Tensor]:
    """The tiny model's tensors in the original checkpoint's names."""
    vae = to_ldm_vae(parts["vae"].state_dict(), len(parts["vae"].config.block_out_channels))
    return {**to_sgm_unet(parts["unet"]),
            **{f"first_stage_model.{k}": v for k, v in vae.items()},
            **_hf_clip(parts["text_encoder"], "cond_stage_model.transformer.")}


@pytest.fixture(scope="module")
def sd15(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path, Path]:
    root = tmp_path_factory.mktemp("sd15")
    parts = build_tiny_sd15()
    path = root / "v1-5-tiny.safetensors"
    save_file(_original(parts), str(path))
    return parts, path, _tokenizer_folder(root, parts, ("tokenizer",))


def _unet_out(unet: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 16, 16, generator=gen)
    ctx = torch.randn(1, 5, unet.config.cross_attention_dim, generator=gen)
    with torch.no_grad():
        return unet(x, 500, ctx).sample


def test_single_file_computes_like_the_original(sd15: tuple) -> None:
    parts, path, folder = sd15
    got = load_sd15_file(_cfg(path, folder, "sd15"), F32)
    torch.testing.assert_close(_unet_out(got["unet"]), _unet_out(parts["unet"]))
    pix = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        torch.testing.assert_close(got["vae"].encode(pix).latent_dist.mean,
                                   parts["vae"].encode(pix).latent_dist.mean)
    assert got["vae"].config.scaling_factor == 0.18215
    _same_text(got["text_encoder"], parts["text_encoder"], parts["tokenizer"])
    assert got["scheduler"].config.prediction_type == "epsilon"
    assert got["name"] == "v1-5-tiny"


def test_unet_matches_diffusers_from_single_file(sd15: tuple, tmp_path: Path) -> None:
    _parts, path, folder = sd15
    (tmp_path / "config.json").write_text(json.dumps(
        {"_class_name": "UNet2DConditionModel", **TINY_SD15_UNET_CONFIG}))
    theirs = UNet2DConditionModel.from_single_file(str(path), config=str(tmp_path),
                                                   local_files_only=True)
    ours = load_sd15_file(_cfg(path, folder, "sd15"), F32)["unet"]
    torch.testing.assert_close(_unet_out(ours), _unet_out(theirs))


def test_full_fine_tune_layout_is_the_original_one(sd15: tuple) -> None:
    """The single file a full fine-tune writes names every tensor as the original does."""
    parts, path, _ = sd15
    layout = single_file_layout(parts["unet"])
    assert set(layout) == set(to_sgm_unet(parts["unet"]))


def test_diffusers_folder_and_its_v_prediction_scheduler(sd15: tuple, tmp_path: Path) -> None:
    """The released folder layout loads; a v-prediction fine-tune's scheduler config is what
    the objective trains with on "auto"."""
    parts, _, _ = sd15
    pipe = StableDiffusionPipeline(**parts, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.scheduler.register_to_config(prediction_type="v_prediction")
    pipe.save_pretrained(tmp_path / "sd15")
    got = load_sd15_folder(tmp_path / "sd15", F32)
    torch.testing.assert_close(_unet_out(got["unet"]), _unet_out(parts["unet"]))
    family = families.get("sd15")
    policy = PrecisionPolicy(torch.device("cpu"), None, torch.float32, torch.float32,
                             torch.float32)
    comps = family.load(ModelConfig(family="sd15", path=tmp_path / "sd15"), policy)
    from difftune.config import TrainConfig

    assert family.objective(comps, TrainConfig()).prediction == "v_prediction"


def test_sdxl_and_sd2_files_are_refused_naming_the_family(sd15: tuple, tmp_path: Path) -> None:
    parts, path, folder = sd15
    state = _original(parts)
    xl = dict(state, **{"model.diffusion_model.label_emb.0.0.weight": torch.zeros(4, 4)})
    save_file(xl, str(tmp_path / "xl.safetensors"))
    with pytest.raises(ModelFileError, match=r"is an SDXL checkpoint.*model.family = \"sdxl\""):
        load_sd15_file(_cfg(tmp_path / "xl.safetensors", folder, "sd15"), F32)
    wide = {k: v for k, v in state.items() if not k.startswith("cond_stage_model.")}
    save_file(wide, str(tmp_path / "no_clip.safetensors"))
    with pytest.raises(ModelFileError, match=r"does not bundle the text encoder"):
        load_sd15_file(_cfg(tmp_path / "no_clip.safetensors", folder, "sd15"), F32)
    with pytest.raises(ModelFileError, match="tokenizers"):
        load_sd15_file(_cfg(path, None, "sd15"), F32)
    # An SD 2.x-like file: its UNet reads another width than the bundled CLIP gives.
    wider = clip_encoder(parts["tokenizer"], 2 * CLIP_L_WIDTH, projection=False, act="gelu")
    save_file({**wide, **_hf_clip(wider, "cond_stage_model.transformer.")},
              str(tmp_path / "sd2.safetensors"))
    with pytest.raises(ModelFileError, match=r"reads 32-wide text, but SD 1.5's CLIP-L gives 64"):
        load_sd15_file(_cfg(tmp_path / "sd2.safetensors", folder, "sd15"), F32)
