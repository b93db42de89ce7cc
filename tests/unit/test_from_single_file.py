"""Our single-file loaders against diffusers' own `from_single_file` (an independent reader).

diffusers' transformer converter hard-codes the FLUX.1 width (3072) when it splits each single
block's fused `linear1`, so that comparison needs full-width blocks: one double and one single
block (about 0.5 B parameters, bf16, random values) keep it affordable on a CPU. The autoencoder
comparison uses the tiny VAE written in the original (LDM/BFL ae) layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from safetensors.torch import save_file

from difftune.families.flux.files import load_transformer_file

from .layouts import to_bfl

CONFIG = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1,
              attention_head_dim=128, num_attention_heads=24, joint_attention_dim=64,
              pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))


# Drawing 0.5 B normal values took most of this test's time; the values only have to tell every
# tensor, row and chunk apart (a swapped q/k/v, shift/scale or block would differ), which random
# windows of a pool whose length is prime (so no chunk of a tensor repeats another) do as well.
_POOL = 1_000_003


def _random_values(shape: torch.Size, pool: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A tensor of `shape` filled from `pool` (cyclically) from a random start."""
    n, start = shape.numel(), int(torch.randint(len(pool), (1,), generator=gen))
    cycles = (start + n) // len(pool) + 1
    return pool.repeat(cycles)[start:start + n].view(shape).clone()


def test_bfl_file_loads_like_diffusers_from_single_file(tmp_path: Path) -> None:
    with torch.device("meta"):
        shapes = FluxTransformer2DModel(**CONFIG).state_dict()
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(_POOL, generator=gen).to(torch.bfloat16)
    state = {k: _random_values(v.shape, pool, gen) for k, v in shapes.items()}
    path = tmp_path / "flux1-fullwidth.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in to_bfl(state).items()}, str(path))
    del state
    config_dir = tmp_path / "config"  # from_single_file reads the model config from here
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(
        {"_class_name": "FluxTransformer2DModel", **CONFIG}))
    ours = load_transformer_file(path, torch.bfloat16).state_dict()
    theirs = FluxTransformer2DModel.from_single_file(
        str(path), config=str(config_dir), local_files_only=True, torch_dtype=torch.bfloat16
    ).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key


def test_ae_file_loads_like_diffusers_from_single_file(tmp_path: Path) -> None:
    from diffusers import AutoencoderKL

    from difftune.families.common.tiny import load_tiny_vae
    from difftune.families.flux.files import load_vae_file

    from .layouts import to_ldm_vae

    vae = load_tiny_vae()
    path = tmp_path / "ae.safetensors"
    n_blocks = len(vae.config.block_out_channels)
    save_file(to_ldm_vae(vae.state_dict(), n_blocks), str(path))
    vae.save_config(tmp_path / "config")
    ours = load_vae_file(path, torch.float32).state_dict()
    theirs = AutoencoderKL.from_single_file(str(path), config=str(tmp_path / "config"),
                                            local_files_only=True).state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
