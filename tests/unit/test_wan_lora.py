"""Wan LoRA names: the default (original) layout is Wan's own module names with `.alpha` where
diffusers' converter reads one, diffusers' own converters read our file and other trainers'
files as meaning the same update, and the names other trainers write read back as ours."""

from __future__ import annotations

import torch
from diffusers.loaders.lora_conversion_utils import (_convert_musubi_wan_lora_to_diffusers,
                                                     _convert_non_diffusers_wan_lora_to_diffusers)

from difftune.adapters.formats import group_modules
from difftune.families.wan.keys import diffusers_names, to_original, to_wan

RANK, ALPHA = 4, 8.0
MODULES = ("blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "blocks.1.attn2.to_v",
           "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2", "condition_embedder.time_proj")


def _state() -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA over MODULES with random factors."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for m in MODULES:
        out[f"transformer.{m}.lora_A.weight"] = torch.randn(RANK, 24, generator=gen)
        out[f"transformer.{m}.lora_B.weight"] = torch.randn(24, RANK, generator=gen)
    return out


def _deltas(state: dict[str, torch.Tensor], alphas: dict[str, float] | float
            ) -> dict[str, torch.Tensor]:
    """{module: its weight change} of a diffusers-named state."""
    return {m: p.delta() for m, p in group_modules(state, alphas).items()}


def test_default_file_names_wans_modules_with_alpha_in_the_blocks() -> None:
    file = to_original(_state(), RANK, ALPHA)
    assert {"diffusion_model.blocks.0.self_attn.q.lora_A.weight",
            "diffusion_model.blocks.0.self_attn.o.lora_B.weight",
            "diffusion_model.blocks.1.cross_attn.v.alpha", "diffusion_model.blocks.1.ffn.0.alpha",
            "diffusion_model.blocks.1.ffn.2.lora_A.weight",
            "diffusion_model.time_projection.1.lora_B.weight"} <= set(file)
    assert "diffusion_model.time_projection.1.alpha" not in file  # folded: see keys.py
    assert float(file["diffusion_model.blocks.0.self_attn.q.alpha"]) == ALPHA


def test_diffusers_reads_our_default_file_as_trained() -> None:
    """diffusers' Wan converter (what WanPipeline.load_lora_weights runs) on our file: the same
    weight change per module (its alpha scales folded into the factors, scale 1)."""
    state = _state()
    want = _deltas(state, ALPHA)  # first: the converter scales some factors in place
    theirs = _convert_non_diffusers_wan_lora_to_diffusers(to_original(state, RANK, ALPHA))
    got = _deltas(theirs, float(RANK))
    assert want.keys() == got.keys()
    for module in want:
        torch.testing.assert_close(got[module], want[module], rtol=1e-5, atol=1e-5)


def test_our_reader_inverts_our_default_file() -> None:
    state = _state()
    back, alphas = diffusers_names(to_original(state, RANK, ALPHA), MODULES)
    want, got = _deltas(state, ALPHA), _deltas(back, {m: alphas.get(m, RANK) for m in
                                                      {k.rsplit(".", 2)[0] for k in back}})
    assert want.keys() == got.keys()
    for module in want:
        torch.testing.assert_close(got[module], want[module], rtol=1e-6, atol=1e-6)


def _musubi(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """musubi-tuner's names for a diffusers-named state: `lora_unet_<Wan name, underscores>`
    with lora_down/lora_up and an alpha per module."""
    out = {}
    for module, pair in group_modules(state, ALPHA).items():
        base = "lora_unet_" + str(to_wan(module.removeprefix("transformer."))).replace(".", "_")
        out |= {f"{base}.lora_down.weight": pair.down, f"{base}.lora_up.weight": pair.up,
                f"{base}.alpha": torch.tensor(ALPHA)}
    return out


def test_musubi_names_read_as_diffusers_reads_them() -> None:
    blocks = {k: v for k, v in _state().items() if k.startswith("transformer.blocks.")}
    # musubi writes every block's attention and FFN layers (diffusers' reader requires them)
    full = {}
    for i in range(2):
        for part in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                     "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj",
                     "ffn.net.2"):
            for f in ("lora_A", "lora_B"):
                key = f"transformer.blocks.{i}.{part}.{f}.weight"
                full[key] = blocks.get(key, torch.full((RANK, 24) if f == "lora_A" else
                                                       (24, RANK), 0.5))
    file = _musubi(full)
    ours, alphas = diffusers_names(file, ())
    theirs = _convert_musubi_wan_lora_to_diffusers(dict(file))
    assert set(ours) == set(theirs) == set(full)
    mine = _deltas(ours, alphas)
    for module, delta in _deltas(theirs, float(RANK)).items():
        torch.testing.assert_close(mine[module], delta, rtol=1e-5, atol=1e-5)


def test_ai_toolkit_and_diffusers_names_read_back() -> None:
    a, b = torch.ones(RANK, 24), torch.zeros(24, RANK)
    want = {"transformer.blocks.0.attn1.to_q.lora_A.weight": a,
            "transformer.blocks.0.attn1.to_q.lora_B.weight": b}
    for file in ({"diffusion_model.blocks.0.self_attn.q.lora_A.weight": a,  # ai-toolkit, Wan's
                  "diffusion_model.blocks.0.self_attn.q.lora_B.weight": b},
                 {"diffusion_model.blocks.0.attn1.to_q.lora_A.weight": a,   # diffusers' names
                  "diffusion_model.blocks.0.attn1.to_q.lora_B.weight": b},
                 dict(want)):
        assert diffusers_names(file, ("blocks.0.attn1.to_q",)) == (want, {})
