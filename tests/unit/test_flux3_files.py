"""FLUX.3 from local files: the folder the modular pipeline saves (modular_model_index.json),
the single files over it (the transformer in BFL's original layout, converted by diffusers'
own converter, written here by the full fine-tune's single-file layout and read back by
diffusers' from_single_file too; FLUX.2's autoencoder; the Qwen3-VL encoder), each equal to the
tiny model it was written from; and the released transformer built on the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from difftune.config import ModelConfig
from difftune.files.single import write_layout
from difftune.families.flux3.files import load_flux3_files, single_file_layout
from difftune.families.flux3.tiny import build_tiny_flux3

from .conftest import assert_same_weights

FP32 = {"transformer": torch.float32, "text_encoders": torch.float32, "vae": torch.float32}


def test_released_transformer_builds_on_meta() -> None:
    """Flux3Transformer2DModel's defaults are the released model: 5.54 B parameters (the
    README's figure), 10.2 M more for the distilled model's target-timestep embedder."""
    from diffusers import Flux3Transformer2DModel

    from difftune.families import registry
    from difftune.families.flux3.files import TRANSFORMER_CONFIG

    with torch.device("meta"):
        base = Flux3Transformer2DModel(**TRANSFORMER_CONFIG)
        distilled = Flux3Transformer2DModel(**TRANSFORMER_CONFIG, flow_map=True)
    n_base = sum(p.numel() for p in base.parameters())
    n_distilled = sum(p.numel() for p in distilled.parameters())
    assert n_base == 5_538_458_368 and n_distilled - n_base == 10_223_616
    assert registry.spec("flux3").sizes[0].denoiser == round(n_base / 1e9, 2)
    assert base.config.joint_attention_dim == 8 * 2560  # eight Qwen3-VL-4B hidden states


@pytest.mark.parametrize("flow_map", [False, True])
def test_transformer_in_bfl_layout_reads_back_and_in_diffusers(tmp_path: Path,
                                                              flow_map: bool) -> None:
    """The BFL-layout file loads equal to the model it was written from, here (also with
    ComfyUI's `model.diffusion_model.` prefix) and in diffusers' from_single_file (which
    converts it; its FLUX.3 converter, like FLUX.2's, keeps that prefix, so not with it)."""
    from diffusers import Flux3Transformer2DModel

    from difftune.families.flux3.single import load_transformer_file

    model = build_tiny_flux3(flow_map)["transformer"]
    layout = single_file_layout(model)
    assert "content_mode_blocks.image.0.q_proj.weight" in layout
    assert ("ref_time_in.in_layer.weight" in layout) == flow_map
    path = write_layout(tmp_path / "flux3.safetensors", layout, model.state_dict(),
                        torch.float32)
    comfy = {f"model.diffusion_model.{k}": p for k, p in layout.items()}
    for file in (path, write_layout(tmp_path / "comfy.safetensors", comfy, model.state_dict(),
                                    torch.float32)):
        assert_same_weights(load_transformer_file(file, torch.float32), model)
    model.save_config(tmp_path / "config")
    theirs = Flux3Transformer2DModel.from_single_file(str(path), config=str(tmp_path / "config"))
    assert_same_weights(theirs, model)


def test_folder_and_single_files_over_it(tmp_path: Path) -> None:
    """The saved modular folder loads equal; single files for all three parts override it
    (the tokenizer still comes from the folder)."""
    from difftune.families import registry
    from difftune.lora_tools.names import tiny_components

    comps = tiny_components("flux3")
    folder = tmp_path / "tiny-flux3"
    registry.get("flux3").pipeline(comps).save_pretrained(str(folder))
    assert (folder / "modular_model_index.json").is_file()
    from difftune.ui.models import recognise_folder  # the web app's model picker knows it

    assert recognise_folder(folder).family == "flux3"
    parts = load_flux3_files(ModelConfig(family="flux3", path=str(folder)), FP32)
    for name, module in (("transformer", comps.denoiser), ("vae", comps.vae),
                         ("text_encoder", comps.text_encoders["qwen3vl"])):
        assert_same_weights(parts[name], module)
    files = {}
    for name, module in (("transformer", comps.denoiser), ("vae", comps.vae),
                         ("text_encoder", comps.text_encoders["qwen3vl"])):
        files[name] = tmp_path / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in module.state_dict().items()}, files[name])
    singles = load_flux3_files(ModelConfig(family="flux3", path=str(folder),
                                           **{k: str(v) for k, v in files.items()}), FP32)
    assert_same_weights(singles["transformer"], comps.denoiser)
    assert_same_weights(singles["vae"], comps.vae)
    lm = singles["text_encoder"].language_model.state_dict()
    assert lm.keys() == comps.text_encoders["qwen3vl"].language_model.state_dict().keys()
    assert singles["fingerprint"] != parts["fingerprint"]


@pytest.mark.full_only  # as the other families' extract cells (tests/e2e/test_lora_extract.py)
def test_lora_extract_reads_the_diffusers_named_file(tmp_path: Path) -> None:
    """`difftune lora extract` on FLUX.3: from diffusers-named files (a folder's transformer/
    weights) the LoRA is diffusers-named and diffusers applies all of it; from BFL-named
    files it is refused, naming the file to pass (no reader takes BFL names in full)."""
    from difftune.errors import ConfigError
    from difftune.lora_tools.extract import extract
    from difftune.lora_tools.verify import verify_file

    model = build_tiny_flux3()["transformer"]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    tuned = dict(state)
    key = "single_transformer_blocks.0.attn.to_q.weight"
    tuned[key] = state[key] + torch.ones(32, 1) @ torch.ones(1, 32)
    save_file(state, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    report = extract(tmp_path / "base.safetensors", tmp_path / "tuned.safetensors", rank=1,
                     out=tmp_path / "lora.safetensors", family="flux3")
    assert report.family == "flux3" and report.spelling == "transformer.<diffusers name>"
    comfy, diffusers = verify_file(report.path, "flux3").results[:2]
    assert diffusers.applied == 1 and not diffusers.dropped and comfy.applied == 0
    bfl = single_file_layout(model)
    for name, which in (("base", state), ("tuned", tuned)):
        write_layout(tmp_path / f"bfl-{name}.safetensors", bfl, which, torch.float32)
    with pytest.raises(ConfigError, match="diffusers-named denoiser file"):
        extract(tmp_path / "bfl-base.safetensors", tmp_path / "bfl-tuned.safetensors", rank=1,
                out=tmp_path / "bfl-lora.safetensors", family="flux3")
