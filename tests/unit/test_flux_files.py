"""Loading FLUX.1 from local files: each layout written from the tiny model, and each error."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.errors import ModelFileError
from difftune.families.common.bfl import rope_axes
from difftune.families.flux import files as flux_files
from difftune.families.flux.files import load_flux_files
from difftune.families.flux.tiny import build_tiny_flux

from .layouts import to_bfl, to_ldm_vae

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}


# --- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny() -> dict:
    return build_tiny_flux()


@pytest.fixture(scope="module")
def folder(tiny: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model saved as a diffusers FLUX.1 folder."""
    from diffusers import FluxPipeline

    path = tmp_path_factory.mktemp("models") / "tiny-flux-dev"
    pipe = FluxPipeline(**{k: v for k, v in tiny.items() if k != "t5_max_length"})
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def files(tiny: dict, folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ComfyUI-style single files, plus a folder holding only the tokenizers."""
    d = tmp_path_factory.mktemp("single")
    bfl = {f"model.diffusion_model.{k}": v for k, v in to_bfl(tiny["transformer"].state_dict()).items()}
    out = {"bfl": d / "flux1-tiny.safetensors", "diff_tr": d / "transformer_diffusers.safetensors",
           "ae": d / "ae.safetensors", "vae_diff": d / "vae_diffusers.safetensors",
           "clip_l": d / "clip_l.safetensors", "clip_v5": d / "clip_v5.safetensors", "t5": d / "t5xxl_fp16.safetensors",
           "toks": d / "tokenizers"}
    save_file(bfl, str(out["bfl"]))
    save_file(_plain(tiny["transformer"]), str(out["diff_tr"]))
    n = len(tiny["vae"].config.block_out_channels)
    save_file(to_ldm_vae(tiny["vae"].state_dict(), n), str(out["ae"]))
    save_file(_plain(tiny["vae"]), str(out["vae_diff"]))
    # clip_l.safetensors files name the tower "text_model.*" (transformers 4 layout)
    save_file({f"text_model.{k}": v for k, v in _plain(tiny["text_encoder"]).items()},
              str(out["clip_l"]))
    save_file(_plain(tiny["text_encoder"]), str(out["clip_v5"]))
    t5 = _plain(tiny["text_encoder_2"])
    t5.pop("encoder.embed_tokens.weight", None)  # stored once as shared.weight, like t5xxl files
    save_file(t5, str(out["t5"]))
    out["toks"].mkdir()
    for name in ("model_index.json", "tokenizer", "tokenizer_2"):
        src = folder / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, out["toks"] / name)
    return out


def _plain(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with untied, contiguous copies (safetensors refuses shared storage)."""
    return {k: v.clone().contiguous() for k, v in model.state_dict().items()}


def _tr_out(tr: torch.nn.Module) -> torch.Tensor:
    """The transformer's output on fixed inputs."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return tr(hidden_states=torch.randn(1, 16, 64, generator=g),
                  encoder_hidden_states=torch.randn(1, 32, 32, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g),
                  timestep=torch.tensor([0.3]), guidance=torch.tensor([3.5]),
                  img_ids=torch.rand(16, 3, generator=g) * 4, txt_ids=torch.zeros(32, 3)).sample


def _te_out(parts: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CLIP pooled output, T5 hidden states and a VAE round trip on fixed inputs."""
    text = ["a red circle on a blue background"]
    ids = parts["tokenizer"](text, padding="max_length", max_length=77, return_tensors="pt")
    ids2 = parts["tokenizer_2"](text, padding="max_length", max_length=32, return_tensors="pt")
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        pooled = parts["text_encoder"](ids.input_ids).pooler_output
        hidden = parts["text_encoder_2"](ids2.input_ids).last_hidden_state
        rec = parts["vae"].decode(parts["vae"].encode(x).latent_dist.mode()).sample
    return pooled, hidden, rec


def _same(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Every component of `b` computes what `a`'s does."""
    torch.testing.assert_close(_tr_out(a["transformer"]), _tr_out(b["transformer"]), atol=atol,
                               rtol=atol)
    for x, y in zip(_te_out(a), _te_out(b)):
        torch.testing.assert_close(x, y, atol=atol, rtol=atol)


# --- loading sources ----------------------------------------------------------------------------

def test_diffusers_folder(tiny: dict, folder: Path) -> None:
    got = load_flux_files(ModelConfig(path=folder), FP32)
    _same(tiny, got)
    assert got["t5_max_length"] == 512 and got["name"] == "tiny-flux-dev"
    assert got["scheduler"].config.use_dynamic_shifting
    again = load_flux_files(ModelConfig(path=folder), FP32)
    assert again["fingerprint"] == got["fingerprint"]
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert load_flux_files(ModelConfig(path=folder), FP32)["fingerprint"] != got["fingerprint"]


def test_folder_dtype(folder: Path) -> None:
    dtypes = {"transformer": torch.bfloat16, "text_encoders": torch.float16, "vae": torch.float32}
    got = load_flux_files(ModelConfig(path=folder), dtypes)
    assert got["transformer"].dtype == torch.bfloat16
    assert got["text_encoder_2"].dtype == torch.float16 and got["vae"].dtype == torch.float32


def test_bfl_single_files(tiny: dict, files: dict) -> None:
    cfg = ModelConfig(path=files["toks"], transformer=files["bfl"], vae=files["ae"],
                      clip_l=files["clip_l"], t5=files["t5"])
    got = load_flux_files(cfg, FP32)
    _same(tiny, got)
    assert got["name"] == "flux1-tiny" and got["t5_max_length"] == 512
    assert got["scheduler"].config.shift == 3.0  # the folder has no scheduler/: dev's, from code


def test_diffusers_layout_single_files(tiny: dict, files: dict) -> None:
    cfg = ModelConfig(path=files["toks"], transformer=files["diff_tr"], vae=files["vae_diff"],
                      clip_l=files["clip_v5"], t5=files["t5"])
    _same(tiny, load_flux_files(cfg, FP32))


def test_single_file_overrides_folder(tiny: dict, folder: Path, files: dict) -> None:
    got = load_flux_files(ModelConfig(path=folder, transformer=files["bfl"]), FP32)
    _same(tiny, got)
    assert got["name"] == "flux1-tiny"


def test_schnell_without_guidance(tiny: dict, files: dict, tmp_path: Path) -> None:
    bfl = {k: v for k, v in to_bfl(tiny["transformer"].state_dict()).items()
           if not k.startswith("guidance_in.")}
    path = tmp_path / "flux1-schnell-tiny.safetensors"
    save_file(bfl, str(path))
    cfg = ModelConfig(path=files["toks"], transformer=path, vae=files["ae"],
                      clip_l=files["clip_l"], t5=files["t5"])
    got = load_flux_files(cfg, FP32)
    assert not got["transformer"].config.guidance_embeds
    assert got["t5_max_length"] == 256
    assert got["scheduler"].config.shift == 1.0 and not got["scheduler"].config.use_dynamic_shifting


def test_fp8_t5(tiny: dict, files: dict, tmp_path: Path) -> None:
    t5 = {k: (v.to(torch.float8_e4m3fn) if v.is_floating_point() else v)
          for k, v in _plain(tiny["text_encoder_2"]).items()}
    path = tmp_path / "t5xxl_fp8_e4m3fn.safetensors"
    save_file(t5, str(path))
    model = flux_files.load_t5_file(path, torch.float32)
    assert model.dtype == torch.float32
    ref = tiny["text_encoder_2"].shared.weight
    torch.testing.assert_close(model.shared.weight, ref, atol=0.1 * ref.abs().max().item(), rtol=0.1)


def test_rope_axes_match_flux() -> None:
    assert rope_axes(128) == (16, 56, 56)
    assert rope_axes(16) == (4, 6, 6)


# --- errors -------------------------------------------------------------------------------------

def test_missing_file(files: dict, tmp_path: Path) -> None:
    missing = tmp_path / "nope.safetensors"
    cfg = ModelConfig(path=files["toks"], transformer=missing, vae=files["ae"],
                      clip_l=files["clip_l"], t5=files["t5"])
    with pytest.raises(ModelFileError, match=r"nope\.safetensors does not exist"):
        load_flux_files(cfg, FP32)


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".pth", ".bin"])
def test_pickle_file_refused(files: dict, tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    path.write_bytes(b"not read")
    cfg = ModelConfig(path=files["toks"], transformer=path)
    with pytest.raises(ModelFileError, match="arbitrary code") as err:
        load_flux_files(cfg, FP32)
    assert "safetensors.torch.save_file" in str(err.value)


def test_pickle_only_folder_refused(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "flux-bin"
    shutil.copytree(folder, copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_name("diffusion_pytorch_model.bin"))
    with pytest.raises(ModelFileError, match="arbitrary code"):
        load_flux_files(ModelConfig(path=copy), FP32)


def test_wrong_file(files: dict) -> None:
    cfg = ModelConfig(path=files["toks"], transformer=files["ae"])
    with pytest.raises(ModelFileError, match="does not look like a FLUX.1 transformer"):
        load_flux_files(cfg, FP32)
    cfg = ModelConfig(path=files["toks"], transformer=files["bfl"], vae=files["clip_l"],
                      clip_l=files["clip_l"], t5=files["t5"])
    with pytest.raises(ModelFileError, match="does not look like an autoencoder"):
        load_flux_files(cfg, FP32)
    cfg = ModelConfig(path=files["toks"], transformer=files["bfl"], vae=files["ae"],
                      clip_l=files["t5"], t5=files["t5"])
    with pytest.raises(ModelFileError, match="does not look like a CLIP"):
        load_flux_files(cfg, FP32)


def test_corrupt_file(files: dict, tmp_path: Path) -> None:
    path = tmp_path / "broken.safetensors"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFileError, match="could not be read as safetensors"):
        load_flux_files(ModelConfig(path=files["toks"], transformer=path), FP32)


def test_not_a_diffusers_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match="no model_index.json"):
        load_flux_files(ModelConfig(path=tmp_path), FP32)
    with pytest.raises(ModelFileError, match="is not a folder"):
        load_flux_files(ModelConfig(path=tmp_path / "missing"), FP32)


def test_missing_component(folder: Path, tmp_path: Path) -> None:
    copy = tmp_path / "flux-partial"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "text_encoder_2")
    with pytest.raises(ModelFileError, match=r"text_encoder_2 is missing"):
        load_flux_files(ModelConfig(path=copy), FP32)


def test_single_files_need_tokenizers(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flux_files, "CLIP_TOKENIZER_REPO", "difftune-test/no-such-clip")
    monkeypatch.setattr(flux_files, "T5_TOKENIZER_REPO", "difftune-test/no-such-t5")
    cfg = ModelConfig(transformer=files["bfl"], vae=files["ae"], clip_l=files["clip_l"],
                      t5=files["t5"])
    with pytest.raises(ModelFileError, match="tokenizer/ and tokenizer_2/"):
        load_flux_files(cfg, FP32)


def test_text_encoders_alone_from_single_files(files: dict) -> None:
    """What a reload after `cache.unload_text_encoders` reads: the same two encoders."""
    from difftune.families.flux.files import load_flux_text_encoders

    cfg = ModelConfig(path=files["toks"], transformer=files["bfl"], vae=files["ae"],
                      clip_l=files["clip_l"], t5=files["t5"])
    full, alone = load_flux_files(cfg, FP32), load_flux_text_encoders(cfg, torch.float32)
    assert set(alone) == {"text_encoder", "text_encoder_2"}
    for name, module in alone.items():
        a, b = module.state_dict(), full[name].state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
