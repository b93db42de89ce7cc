"""The LyCORIS-layout tensors mean the trained update under ComfyUI's reading rules, and read
back into a fresh model exactly (`adapters.lycoris_files`).

ComfyUI's rules, as comfy/lora.py `calculate_weight` (and comfy/weight_adapter/{lora,loha,
lokr}.py) apply them: LoRA `up.flatten(1) @ down.flatten(1)`, LoHa `(w1_a @ w1_b) * (w2_a @
w2_b)`, LoKr `kron(w1, w2)` (w1 = w1_a @ w1_b and w2 = w2_a @ w2_b where split; for a conv
layer w1 gains two unit axes), each reshaped to the weight and scaled by `alpha / dim`, dim
being `lora_down`'s, `hada_w1_b`'s, or LoKr's `w1_b`'s, else `w2_b`'s rows; 1 when LoKr has no
split factor or the file no alpha."""

from __future__ import annotations

import pytest
import torch

from difftune.adapters.kinds import AdapterOptions
from difftune.adapters.lora import add_lora
from difftune.adapters.lycoris_files import adapted_layers, load_into, to_file


class Family:
    denoiser_prefix, lycoris_prefix, text_encoder_prefixes = "unet", "lycoris", {}
    lycoris_renames: tuple[tuple[str, str], ...] = ()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 48)
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)


def comfy_delta(t: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """One module's update from its file tensors, by ComfyUI's rules."""
    alpha = float(t["alpha"]) if "alpha" in t else None
    if "lora_up.weight" in t:
        up, down = t["lora_up.weight"], t["lora_down.weight"]
        diff, dim = up.flatten(1) @ down.flatten(1), down.shape[0]
    elif "hada_w1_a" in t:
        diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        dim = t["hada_w1_b"].shape[0]
    else:
        dim = None
        w1 = t.get("lokr_w1")
        if w1 is None:
            w1, dim = t["lokr_w1_a"] @ t["lokr_w1_b"], t["lokr_w1_b"].shape[0]
        w2 = t.get("lokr_w2")
        if w2 is None:
            w2, dim = t["lokr_w2_a"] @ t["lokr_w2_b"], t["lokr_w2_b"].shape[0]
        if w2.ndim == 4:
            w1 = w1[:, :, None, None]
        diff = torch.kron(w1, w2)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    return diff.reshape(weight.shape) * scale


OPTIONS = {
    "locon": AdapterOptions(rank=4, alpha=2.0, conv_rank=3, conv_alpha=5.0),
    "loha": AdapterOptions(rank=4, alpha=6.0, conv_rank=2, conv_alpha=1.0),
    "lokr-split": AdapterOptions(rank=2, alpha=3.0, factor=4, decompose_both=True, conv_rank=1),
    "lokr-whole": AdapterOptions(rank=4, alpha=4.0, full_matrix=True, conv_rank=4),
    # rank 4 keeps proj's factors whole (peft's scale 7/4 folded into lokr_w1), conv's split
    "lokr-auto": AdapterOptions(rank=4, alpha=7.0, conv_rank=2),
}
# A tensor each case's file must hold (the branch it exercises).
EXPECTED = {"locon": "lycoris_conv.lora_down.weight", "loha": "lycoris_conv.hada_w2_b",
            "lokr-split": "lycoris_conv.lokr_w1_a", "lokr-whole": "lycoris_conv.lokr_w2",
            "lokr-auto": "lycoris_conv.lokr_w2_a"}


def adapted(name: str, seed: int) -> tuple[Net, dict]:
    """A net with `name`'s adapter on both layers, its factors random (as after training)."""
    net = Net()
    kind = name.split("-")[0]
    add_lora(net, [r"proj"], 0, 0.0, 0.0, seed, kind, OPTIONS[name], [r"conv"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if "base_layer" not in n:
                p.copy_(torch.randn(p.shape, generator=gen))
    return net, adapted_layers(Family, {"unet": net}, {})


@pytest.mark.parametrize("name", list(OPTIONS))
def test_the_file_means_the_trained_update_and_reads_back(name: str) -> None:
    net, layers = adapted(name, 1)
    tensors = to_file(layers)
    assert set(layers) == {"lycoris_proj", "lycoris_conv"} and EXPECTED[name] in tensors
    if name == "lokr-auto":
        assert "lycoris_proj.lokr_w2" in tensors and float(layers["lycoris_proj"].scaling[
            "default"]) == 7 / 4
    for module, layer in layers.items():
        mine = {k.partition(".")[2]: v for k, v in tensors.items() if k.startswith(module + ".")}
        want = layer.get_delta_weight("default")
        torch.testing.assert_close(comfy_delta(mine, want), want, rtol=1e-5, atol=1e-5)
    fresh, fresh_layers = adapted(name, 2)
    assert load_into("file", fresh_layers, tensors) == []
    x = torch.randn(2, 64)
    torch.testing.assert_close(fresh.proj(x), net.proj(x), rtol=1e-5, atol=1e-5)
    img = torch.randn(1, 16, 5, 5)
    torch.testing.assert_close(fresh.conv(img), net.conv(img), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(OPTIONS) + ["dora"])
def test_a_new_adapter_changes_nothing_is_seeded_and_leaves_the_global_rng(name: str) -> None:
    options = OPTIONS.get(name, AdapterOptions(rank=4, alpha=4.0, dora=True, conv_rank=2))
    kind = "locon" if name == "dora" else name.split("-")[0]
    made = []
    for _ in range(2):
        net = Net().to(torch.bfloat16)
        before = torch.get_rng_state()
        add_lora(net, [r"proj"], 0, 0.0, 0.0, 7, kind, options, [r"conv"])
        assert torch.equal(before, torch.get_rng_state())
        made.append({n: p.detach().clone() for n, p in net.named_parameters()
                     if p.requires_grad})
    assert made[0] and all(p.dtype == torch.float32 for p in made[0].values())
    assert all(torch.equal(made[0][k], made[1][k]) for k in made[0])  # seeded
    for layer in adapted_layers(Family, {"unet": net}, {}).values():
        assert not bool(layer.get_delta_weight("default").any())  # the update starts at zero
