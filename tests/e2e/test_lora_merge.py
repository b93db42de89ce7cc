"""`difftune lora merge`: into a base model file, equal to diffusers' own `fuse_lora` of the
same LoRA on the same tiny model (single-file and diffusers-named bases, fused and swapped
tensors included); LoRA + LoRA exact by concatenation and the best cut with --rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune.adapters.formats import save_lora
from difftune.cli import main
from difftune.families import registry
from difftune.files.single import build, write_layout
from difftune.lora_tools.merge_base import merge_into_base
from difftune.lora_tools.merge_loras import merge_loras
from difftune.lora_tools.names import tiny_components

from ..lora_files import diffusers_lora, linear_modules, spelled

FAMILIES = list(registry.names())
FAST = ("flux", "sdxl", "z_image")  # the rest: --full


def fused_state(family: str, lora: Path, weight: float) -> dict[str, torch.Tensor]:
    """The tiny denoiser's weights after diffusers' `fuse_lora` of the file at `weight`."""
    comps = tiny_components(family)
    pipe = registry.get(family).pipeline(comps)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora(lora_scale=weight)
    pipe.unload_lora_weights()
    return comps.denoiser.state_dict()


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in FAST else
                                                 pytest.mark.full_only) for f in FAMILIES])
def test_merge_into_single_file_equals_diffusers_fuse(tmp_path: Path, family: str) -> None:
    fam, comps = registry.get(family), tiny_components(family)
    layout = fam.single_file_layout(comps)
    base = write_layout(tmp_path / "base.safetensors", layout, comps.denoiser.state_dict(),
                        torch.float32)
    lora = save_lora(tmp_path / "lora.safetensors",
                     diffusers_lora(family, linear_modules(family)), {})
    out = tmp_path / "merged.safetensors"
    assert main(["lora", "merge", str(base), "--lora", f"{lora}:0.7", "--out", str(out)]) == 0
    merged, before = load_file(str(out)), load_file(str(base))
    fused = fused_state(family, lora, 0.7)
    for key, piece in layout.items():
        assert merged[key].dtype == before[key].dtype
        torch.testing.assert_close(merged[key], build(piece, fused), rtol=0, atol=0, msg=key)
    assert any(not torch.equal(merged[k], before[k]) for k in before)


def test_kohya_lora_into_a_diffusers_named_base(tmp_path: Path) -> None:
    """Original (fused) module names split into diffusers' rows, halves swapped back; a bf16
    base stays bf16."""
    comps = tiny_components("flux")
    state = diffusers_lora("flux", linear_modules("flux"))
    kohya = registry.get("flux").lora_to_format(comps, state, "kohya", 4, 4.0)
    lora = save_lora(tmp_path / "k.safetensors", kohya, {})
    base = tmp_path / "base.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous()
               for k, v in comps.denoiser.state_dict().items()}, str(base))
    report = merge_into_base(base, [(lora, 1.0)], tmp_path / "m.safetensors")
    merged = load_file(report.path)
    fused = fused_state("flux", save_lora(tmp_path / "d.safetensors", state, {}), 1.0)
    for key, value in fused.items():
        assert merged[key].dtype == torch.bfloat16
        torch.testing.assert_close(merged[key].float(), value, rtol=2e-2, atol=2e-2, msg=key)


def test_lora_plus_lora(tmp_path: Path) -> None:
    modules = linear_modules("z_image", r"attention\.to_q$")
    a = spelled(diffusers_lora("z_image", modules, rank=3, seed=1), "lora_unet_", True, 1.5,
                ("lora_down.weight", "lora_up.weight"))
    b = spelled(diffusers_lora("z_image", modules, rank=2, seed=2), "lora_unet_", True, 4.0,
                ("lora_down.weight", "lora_up.weight"))
    pa, pb = save_lora(tmp_path / "a.safetensors", a, {}), save_lora(tmp_path / "b.safetensors",
                                                                      b, {})

    def delta(t: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
        down, up = t[f"{stem}.lora_down.weight"], t[f"{stem}.lora_up.weight"]
        return float(t[f"{stem}.alpha"]) / down.shape[0] * up @ down

    whole = load_file(merge_loras(pa, [(pb, 0.5)], tmp_path / "ab.safetensors").path)
    cut = load_file(merge_loras(pa, [(pb, 0.5)], tmp_path / "c.safetensors", rank=1).path)
    for stem in {k.split(".")[0] for k in a}:
        total = delta(a, stem) + 0.5 * delta(b, stem)
        torch.testing.assert_close(delta(whole, stem), total, rtol=1e-5, atol=1e-5)
        assert whole[f"{stem}.lora_down.weight"].shape[0] == 5
        u, s, vh = torch.linalg.svd(total.double())
        torch.testing.assert_close(delta(cut, stem).double(), s[0] * torch.outer(u[:, 0], vh[0]),
                                   rtol=1e-4, atol=1e-5)


def test_merge_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    comps = tiny_components("z_image")
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in comps.denoiser.state_dict().items()}, str(base))
    lokr = save_lora(tmp_path / "dora.safetensors",
                     {"lycoris_layers_0_attention_to_q.lora_down.weight": torch.zeros(2, 64),
                      "lycoris_layers_0_attention_to_q.lora_up.weight": torch.zeros(64, 2),
                      "lycoris_layers_0_attention_to_q.dora_scale": torch.ones(64, 1)}, {})
    assert main(["lora", "merge", str(base), "--lora", str(lokr)]) == 2
    assert "is a DoRA" in capsys.readouterr().err
    assert main(["lora", "merge", str(base), "--lora", f"{lokr}:strong"]) == 2
    assert "must be a number" in capsys.readouterr().err
    assert main(["lora", "merge", str(base), "--lora", str(lokr), "--out", str(base)]) == 2
    assert "input file" in capsys.readouterr().err
    assert not (tmp_path / "base-merged.safetensors").exists()
    assert main(["lora", "merge", str(tmp_path / "none.safetensors"), "--lora", str(lokr)]) == 2
    assert "none.safetensors does not exist" in capsys.readouterr().err
    (tmp_path / "model.ckpt").write_bytes(b"pickle")
    assert main(["lora", "merge", str(tmp_path / "model.ckpt"), "--lora", str(lokr)]) == 2
    assert "model.ckpt" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["loha", "lokr"])
def test_loha_and_lokr_merge_as_the_lycoris_library_applies_them(tmp_path: Path,
                                                                 kind: str) -> None:
    """A LoHa / LoKr file merged into a diffusers-named base: the merged layer's output is
    the LyCORIS library's (`adapters.lycoris_files.apply_file`) on the base model."""
    from difftune.adapters.lycoris_files import apply_file

    comps = tiny_components("z_image")
    base = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in comps.denoiser.state_dict().items()}, str(base))
    layer = comps.denoiser.get_submodule("layers.0.attention.to_q")
    rows, cols = layer.weight.shape
    gen = torch.Generator().manual_seed(4)
    stem = "lycoris_layers_0_attention_to_q"
    parts = ({"hada_w1_a": (rows, 2), "hada_w1_b": (2, cols), "hada_w2_a": (rows, 2),
              "hada_w2_b": (2, cols)} if kind == "loha" else
             {"lokr_w1": (2, 2), "lokr_w2_a": (rows // 2, 2), "lokr_w2_b": (2, cols // 2)})
    tensors = {f"{stem}.{n}": torch.randn(*shape, generator=gen) * 0.3
               for n, shape in parts.items()} | {f"{stem}.alpha": torch.tensor(1.0)}
    lora = save_lora(tmp_path / f"{kind}.safetensors", tensors, {})
    merged = load_file(merge_into_base(base, [(lora, 0.8)], tmp_path / "m.safetensors").path)
    x = torch.randn(3, cols, generator=gen)
    nets = apply_file(registry.get("z_image"), {"transformer": comps.denoiser}, {},
                      tensors, 0.8)
    with torch.no_grad():
        want = layer(x)
        got = torch.nn.functional.linear(x, merged["layers.0.attention.to_q.weight"],
                                         merged.get("layers.0.attention.to_q.bias"))
        before = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert nets and not torch.allclose(want, before, atol=1e-3)  # the file changes the layer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
