"""Files that load right everywhere, and bad files refused with exit 2 (issue 14).

Every run goes through the real CLI on a tiny flavor. Where no independent implementation can
be run here (ComfyUI is not pip-installable), the test applies ComfyUI's own rules, read from
its source:

- comfy/lora.py at commit 41444b5236c613ee5ff7d09aa620f94b702f30eb:
  `load_lora` takes a module's factors from `{x}.lora_B.weight` / `{x}.lora_A.weight` (or
  `{x}.lora_up.weight` / `{x}.lora_down.weight`) and its alpha only from a `{x}.alpha` tensor;
  `calculate_weight` applies `alpha / rank` when that tensor exists and 1.0 when it does not
  (never the safetensors metadata); `model_lora_keys_clip` maps diffusers-format CLIP LoRAs
  only as `text_encoder.text_model.encoder.layers.{b}.{c}` (CLIP-L) and
  `text_encoder_2.text_model.encoder.layers.{b}.{c}` (CLIP-G beside a CLIP-L), with `c` one of
  `self_attn.{q,k,v,out}_proj`, `mlp.fc1`, `mlp.fc2`, and kohya CLIP LoRAs as
  `lora_te1_text_model_encoder_layers_{b}_{c'}` / `lora_te2_...` (`c'` with underscores).
- comfy/weight_adapter/lora.py at commit 0323d8746da9beb8f3face4b77305af8d58319d6:
  `LoRAAdapter.calculate_weight` uses the same rule (alpha None -> scale 1.0).
"""

from __future__ import annotations

import json
import os
import re
import stat
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.cli import main

from .conftest import lora_metadata, run_toml, tiny_pipeline, train_cli

RANK, ALPHA = 4, 3  # scale 0.75: a file read with the wrong scale is 1.33x too strong
CLIP_MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


# ---------------------------------------------------------------------------- helpers


def train(folder: Path, images: Path, family: str, *sets: str, fmt: str | None = "diffusers",
          steps: int = 1, extra: str = "") -> Path:
    """A run through the CLI (rank 4, alpha 3 unless `sets` say otherwise); the output folder."""
    return train_cli(folder, images, f"adapter.alpha={ALPHA}", *sets, family=family, fmt=fmt,
                     steps=steps, extra=extra)


def trained_deltas(out: Path, alpha: float = ALPHA) -> dict[str, torch.Tensor]:
    """`alpha/rank * B @ A` of every module, from the run's last checkpoint (model naming)."""
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    state = load_file(str(last / "trainable.safetensors"))
    return {key.removesuffix(".lora_A.weight"):
            (alpha / RANK) * state[key.replace("lora_A", "lora_B")] @ value
            for key, value in state.items() if key.endswith(".lora_A.weight")}


def comfy_deltas(file: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weight change ComfyUI applies per module at strength 1 (its `load_lora` and
    `calculate_weight`, see the module docstring): alpha from `{x}.alpha` only, else scale 1."""
    out = {}
    for key, up in file.items():
        for up_suffix, down_suffix in ((".lora_B.weight", ".lora_A.weight"),
                                       (".lora_up.weight", ".lora_down.weight")):
            if key.endswith(up_suffix):
                x = key.removesuffix(up_suffix)
                down = file[x + down_suffix].float()
                alpha = file.get(f"{x}.alpha")
                scale = 1.0 if alpha is None else alpha.item() / down.shape[0]
                out[x] = scale * up.float() @ down
    return out


def comfy_clip_keys(prefix: str, layers: int) -> set[str]:
    """The diffusers-format CLIP module names ComfyUI's `model_lora_keys_clip` maps."""
    return {f"{prefix}.text_model.encoder.layers.{b}.{c}" for b in range(layers)
            for c in CLIP_MODULES}


def diffusers_deltas(pipe: object, component: str) -> dict[str, torch.Tensor]:
    """`scaling * B @ A` of every LoRA layer diffusers' loader put into a pipeline part."""
    out = {}
    for name, module in getattr(pipe, component).named_modules():
        if hasattr(module, "lora_A") and module.lora_A:
            adapter = next(iter(module.lora_A))
            delta = module.lora_B[adapter].weight @ module.lora_A[adapter].weight
            out[f"{component}.{name}"] = module.scaling[adapter] * delta
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key].float(), value.float(), rtol=1e-5, atol=1e-7,
                                   msg=key)


# ------------------------------------------------- 1. alpha in diffusers-format files


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_diffusers_file_reads_the_same_in_comfyui_and_diffusers(
        tmp_path: Path, images: Path, family: str) -> None:
    """alpha != rank: ComfyUI (no `.alpha` tensor: scale 1) and diffusers (lora_alpha from the
    metadata) must apply the trained delta, and ss_network_alpha must say what the file holds."""
    out = train(tmp_path, images, family, "adapter.targets=\"attention\"")
    lora = out / "lora.safetensors"
    file = load_file(str(lora))
    want = trained_deltas(out)
    assert not [k for k in file if k.endswith(".alpha")]
    assert_same(comfy_deltas(file), want)
    pipe = tiny_pipeline(family)
    pipe.load_lora_weights(str(lora))  # diffusers' own loader, metadata and all
    assert_same(diffusers_deltas(pipe, "transformer"), want)
    meta = lora_metadata(lora)
    assert meta["ss_network_dim"] == str(RANK)
    assert float(meta["ss_network_alpha"]) == RANK  # the scale is in the up factors
    packed = json.loads(meta["lora_adapter_metadata"])
    assert packed["transformer.lora_alpha"] == RANK and packed["transformer.r"] == RANK


def _old_style_file(out: Path, path: Path, alpha: float = ALPHA) -> Path:
    """A diffusers file as difftune wrote it before alphas were folded: the raw factors, the
    alpha in the metadata only (difftune.alpha and lora_adapter_metadata)."""
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    state = load_file(str(last / "trainable.safetensors"))
    meta = lora_metadata(out / "lora.safetensors")
    packed = {k: (alpha if k.endswith("lora_alpha") else v)
              for k, v in json.loads(meta["lora_adapter_metadata"]).items()}
    meta.update({"difftune.alpha": str(float(alpha)),
                 "lora_adapter_metadata": json.dumps(packed)})
    save_file(state, str(path), metadata=meta)
    return path


def test_init_lora_gives_the_trained_weights_from_new_and_old_files(
        tmp_path: Path, images: Path) -> None:
    """--init-lora, from a folded file and from one written before the fix, starts a run
    (same rank and alpha) from the trained weights; resume is checked in test_resume."""
    from difftune.config import load_config
    from difftune.train.checkpoint import CheckpointManager
    from difftune.train.init_lora import load_init_lora
    from difftune.train.setup import prepare

    out = train(tmp_path / "src", images, "flux", 'adapter.text_encoders=["clip_l"]')
    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    src = load_file(str(last / "trainable.safetensors"))
    old = _old_style_file(out, tmp_path / "old.safetensors")
    for file in (out / "lora.safetensors", old):
        cfg = load_config(run_toml(tmp_path / file.stem, images, family="flux"),
                          [f"adapter.alpha={ALPHA}", 'adapter.text_encoders=["clip_l"]'])
        run = prepare(cfg, show_progress=False)
        manager = CheckpointManager(cfg, run.family, run.comps, run.targets, {})
        load_init_lora(file, manager)
        got = manager.trainable()
        assert set(got) == set(src)
        for key, value in src.items():
            torch.testing.assert_close(got[key].detach(), value, rtol=1e-6, atol=0, msg=key)


# ------------------------------------------------- 2. CLIP keys every reader maps


def test_clip_lora_keys_are_the_ones_comfyui_and_diffusers_map(
        tmp_path: Path, images: Path) -> None:
    """FLUX.1 with a CLIP-L LoRA, diffusers format: every text-encoder key is one ComfyUI's
    `model_lora_keys_clip` maps, at the trained strength; diffusers' own loader reads the same
    file into the flattened transformers CLIPTextModel with the same deltas."""
    out = train(tmp_path, images, "flux", 'adapter.text_encoders=["clip_l"]',
                'adapter.targets="attention"')
    lora = out / "lora.safetensors"
    file = load_file(str(lora))
    layers = tiny_pipeline("flux").text_encoder.config.num_hidden_layers
    clip = {k.rsplit(".", 2)[0] for k in file if k.startswith("text_encoder.")}
    assert clip and clip <= comfy_clip_keys("text_encoder", layers)
    want = trained_deltas(out)
    comfy = {k.replace("text_encoder.text_model.", "text_encoder."): v
             for k, v in comfy_deltas(file).items()}
    assert_same(comfy, want)
    pipe = tiny_pipeline("flux")
    pipe.load_lora_weights(str(lora))
    theirs = diffusers_deltas(pipe, "transformer") | diffusers_deltas(pipe, "text_encoder")
    assert_same(theirs, want)


def test_init_lora_reads_both_clip_namings(tmp_path: Path, images: Path) -> None:
    """A file whose CLIP keys lack `text_model.` (difftune's naming before the fix) still
    starts a run from its weights, through the CLI."""
    out = train(tmp_path / "src", images, "flux", 'adapter.text_encoders=["clip_l"]')
    file = load_file(str(out / "lora.safetensors"))
    flat = {k.replace("text_encoder.text_model.", "text_encoder."): v for k, v in file.items()}
    assert flat.keys() != file.keys()
    old = tmp_path / "flat.safetensors"
    save_file(flat, str(old), metadata=lora_metadata(out / "lora.safetensors"))
    for init in (out / "lora.safetensors", old):
        folder = tmp_path / f"init-{init.stem}"
        assert main(["train", str(run_toml(folder, images, family="flux", steps=1)), "--no-progress",
                     "--set", f"adapter.alpha={ALPHA}", "--set",
                     'adapter.text_encoders=["clip_l"]', "--init-lora", str(init)]) == 0
        log = (folder / "out" / "difftune.log").read_text()
        assert "lacks" not in log  # every trained module came from the file


# ------------------------------------------------- 3. per-family default format


def test_sdxl_defaults_to_kohya_and_check_says_so(tmp_path: Path, images: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """save.format unset: SDXL writes kohya keys (the layout ComfyUI and diffusers both read
    fully), `check` says which format and why, and the resolved config shows it; an explicit
    save.format is kept."""
    cfg = run_toml(tmp_path / "check", images, family="sdxl", fmt=None)
    assert main(["check", str(cfg)]) == 0
    said = capsys.readouterr().out
    assert re.search(r"LoRA file format: kohya \(the sdxl default", said), said
    out = train(tmp_path / "default", images, "sdxl", 'adapter.text_encoders=["clip_l"]',
                fmt=None)
    keys = set(load_file(str(out / "lora.safetensors")))
    assert keys and all(k.startswith(("lora_unet_", "lora_te1_")) for k in keys)
    te1 = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
           for k in keys if k.startswith("lora_te1_")}
    layers = tiny_pipeline("sdxl").text_encoder.config.num_hidden_layers
    assert te1 <= {f"lora_te1_text_model_encoder_layers_{b}_{c.replace('.', '_')}"
                   for b in range(layers) for c in CLIP_MODULES}
    resolved = json.loads((out / "config.resolved.json").read_text())
    assert resolved["save"]["format"] == "kohya"
    assert lora_metadata(out / "lora.safetensors")["difftune.format"] == "kohya"
    explicit = train(tmp_path / "explicit", images, "sdxl", fmt="diffusers")
    assert json.loads((explicit / "config.resolved.json").read_text())["save"]["format"] == \
        "diffusers"
    assert all(k.startswith("unet.") for k in load_file(str(explicit / "lora.safetensors")))
    flux = run_toml(tmp_path / "flux", images, family="flux", fmt=None)
    assert main(["check", str(flux)]) == 0
    assert "LoRA file format: diffusers (the flux default" in capsys.readouterr().out


# ------------------------------------------------- 4. metadata tools read, file modes


def test_metadata_that_model_managers_read(tmp_path: Path, images: Path) -> None:
    """kohya's ss_* keys and the SAI model spec keys, with the true values of the file."""
    flux = lora_metadata(train(tmp_path / "flux", images, "flux", "save.name=\"myflux\"",
                          fmt="kohya") / "myflux.safetensors")
    assert flux["ss_network_module"] == "networks.lora_flux"
    assert flux["ss_network_dim"] == str(RANK) and float(flux["ss_network_alpha"]) == ALPHA
    assert flux["ss_base_model_version"] == "flux1"
    assert flux["ss_output_name"] == "myflux" and flux["ss_steps"] == "1"
    assert flux["ss_resolution"] == "(64, 64)"
    assert flux["modelspec.sai_model_spec"] == "1.0.0"
    assert flux["modelspec.architecture"] == "flux-1-dev/lora"  # the tiny model has guidance
    assert flux["modelspec.implementation"] == "https://github.com/black-forest-labs/flux"
    assert flux["modelspec.title"] == "myflux" and flux["modelspec.resolution"] == "64x64"
    assert abs((datetime.fromisoformat(flux["modelspec.date"]) -
                datetime.now().astimezone()).total_seconds()) < 600
    sdxl = lora_metadata(train(tmp_path / "sdxl", images, "sdxl", fmt=None) / "lora.safetensors")
    assert sdxl["ss_network_module"] == "networks.lora"
    assert sdxl["ss_base_model_version"] == "sdxl_base_v1-0"
    assert sdxl["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert float(sdxl["ss_network_alpha"]) == ALPHA  # kohya files keep alpha in `.alpha`


def test_every_file_follows_the_umask(tmp_path: Path, images: Path) -> None:
    """LoRAs, step LoRAs, embeddings and checkpoint files get the mode the umask gives any
    other file (a ComfyUI running as another user must be able to read them)."""
    extra = ('[[adapter.embeddings]]\nname = "<sks>"\ntokens = 1\ninit = "a circle"\n'
             'encoders = ["clip_l"]\n')
    old = os.umask(0o027)
    try:
        out = train(tmp_path, images, "flux", "save.every_n_steps=1", steps=2, extra=extra)
    finally:
        os.umask(old)
    files = [p for p in out.rglob("*") if p.is_file()]
    kinds = {p.name for p in files}
    assert {"lora.safetensors", "lora-step000001.safetensors", "sks.safetensors",
            "trainable.safetensors"} <= kinds, kinds
    wrong = {str(p.relative_to(out)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
             if stat.S_IMODE(p.stat().st_mode) != 0o640}
    assert not wrong
