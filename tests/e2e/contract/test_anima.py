"""Anima-only behaviour through the real CLI on the tiny flavor: --init-lora from sd-scripts'
Anima files (`lora_unet_` names with `.alpha`), a file that also adapts the LLM adapter, which
difftune does not train, refused by `check` naming those modules, and a full fine-tune's
single file holding the adapter (the training paths every family takes are in
test_training_paths)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main
from difftune.families.anima.keys import to_original

from ..conftest import metrics_rows, run_toml, train_exit_code

# The contract run's diffusers-layout file: rank 4, its scale folded into the up factors (its
# alpha is the rank, scale 1); the copies below say alpha 4 for each module, the same scale.
RANK = 4


def _copy(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our file as sd-scripts writes Anima LoRAs (`lora_unet_<original name, underscored>`,
    lora_down/lora_up, `.alpha`)."""
    out = {}
    for key, value in ours.items():
        module, factor, _ = key.removeprefix("transformer.").rsplit(".", 2)
        base = "lora_unet_" + str(to_original(module)).replace(".", "_")
        factor = {"lora_A": "lora_down", "lora_B": "lora_up"}[factor]
        out[f"{base}.{factor}.weight"] = value
        out[f"{base}.alpha"] = torch.tensor(float(RANK))
    return out


def test_init_lora_from_other_tools_names(trained: Callable[[str], Path], images: Path,
                                          tmp_path: Path) -> None:
    """Starting from sd-scripts' copy of our file is starting from ours (ComfyUI's spelling
    is read by the same reader: tests/unit/test_anima_files.py)."""
    ours = trained("anima") / "lora.safetensors"
    files = {"ours": ours, "sd_scripts": tmp_path / "sd_scripts.safetensors"}
    save_file(_copy(load_file(str(ours))), str(files["sd_scripts"]))
    losses = {}
    for name, init in [*files.items(), ("fresh", None)]:
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="anima")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses[name] = metrics_rows(tmp_path / name / "out")[0]["loss"]
    assert losses["sd_scripts"] == losses["ours"] != losses["fresh"]


def test_check_names_llm_adapter_modules_it_would_not_load(
        trained: Callable[[str], Path], images: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """sd-scripts can train the LLM adapter too (`lora_unet_llm_adapter_...`): difftune's
    Anima LoRAs adapt the transformer only, so such a file is refused with those modules
    named rather than started from with part of it silently dropped."""
    adapter = _copy(load_file(str(trained("anima") / "lora.safetensors")))
    base = "lora_unet_llm_adapter_blocks_0_cross_attn_q_proj"
    adapter[f"{base}.lora_down.weight"] = torch.zeros(RANK, 32)
    adapter[f"{base}.lora_up.weight"] = torch.zeros(32, RANK)
    path = tmp_path / "with_adapter.safetensors"
    save_file(adapter, str(path))
    cfg = run_toml(tmp_path, images, family="anima")
    assert main(["check", str(cfg), "--init-lora", str(path)]) == 2
    err = capsys.readouterr().err
    assert "adapts Anima's LLM adapter (lora_unet_llm_adapter_blocks_0_cross_attn_q_proj)" in err
    assert "Traceback" not in err


def test_full_finetune_single_file_is_an_anima_file(images: Path, tmp_path: Path) -> None:
    """A full fine-tune's single file holds the trained DiT in the original names and the LLM
    adapter (by which ComfyUI tells Anima from Cosmos-Predict2): read back as an Anima
    transformer file, it is the trained transformer and the base model's adapter."""
    from diffusers import CosmosTransformer3DModel

    from difftune.families.anima.files import load_transformer_file
    from difftune.families.anima.tiny import build_tiny_anima

    cfg = run_toml(tmp_path, images, steps=1, family="anima", fmt=None)
    cfg.write_text(cfg.read_text().replace('rank = 4\nalpha = 8\ntargets = "all_linear"',
                                           'type = "full"'))
    assert train_exit_code(cfg) == 0
    transformer, adapter = load_transformer_file(tmp_path / "out" / "lora.safetensors",
                                                 torch.float32)
    trained = CosmosTransformer3DModel.from_pretrained(str(tmp_path / "out" / "lora"),
                                                       subfolder="transformer")
    base = build_tiny_anima()
    for got, want in ((transformer, trained), (adapter, base["text_conditioner"])):
        a, b = got.state_dict(), want.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(trained.proj_out.weight, base["transformer"].proj_out.weight)


def test_an_sd_scripts_anima_config_imports_as_an_anima_run(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    """anima_train_network.py's config (its network module names the model) becomes an Anima
    run with its three files in place."""
    (tmp_path / "ds.toml").write_text('[[datasets]]\n[[datasets.subsets]]\nimage_dir = "img"\n',
                                      encoding="utf-8")
    files = {key: (tmp_path / name).as_posix() for key, name in (
        ("transformer", "anima-base-v1.0.safetensors"),
        ("text_encoder", "qwen_3_06b_base.safetensors"), ("vae", "qwen_image_vae.safetensors"))}
    (tmp_path / "kohya.toml").write_text(
        'network_module = "networks.lora_anima"\n'
        f'pretrained_model_name_or_path = "{files["transformer"]}"\n'
        f'qwen3 = "{files["text_encoder"]}"\nvae = "{files["vae"]}"\n'
        f'dataset_config = "{(tmp_path / "ds.toml").as_posix()}"\n', encoding="utf-8")
    out = tmp_path / "run.toml"
    assert main(["import", "kohya", str(tmp_path / "kohya.toml"), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert 'family = "anima"' in text
    for key, path in files.items():
        line = f'{key} = "{path}"'
        assert line in text, line
