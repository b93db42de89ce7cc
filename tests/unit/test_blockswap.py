"""Block swap on a tiny FLUX transformer (CPU): same numbers, few blocks loaded, right order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from diffusers import FluxTransformer2DModel

from difftune.adapters.lora import add_lora, lora_parameters
from difftune.families.common.latents import image_ids
from difftune.families.flux.family import FluxFamily
from difftune.memory.blockswap import BlockSwap

TINY = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=3,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
CPU = torch.device("cpu")
SWAPPED = (2, 3, 4)  # count=3 of 5 blocks


def build(base: str = "fp32") -> FluxTransformer2DModel:
    """The tiny transformer (seeded), frozen, with a LoRA whose B is not zero (A gets grads)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**TINY)
    model.requires_grad_(False)
    if base == "fp8":
        from difftune.precision.lowbit import store_fp8

        store_fp8(model, torch.float32, FluxFamily.keep_high["denoiser"])
    elif base == "int8":
        from difftune.precision.lowbit import quantize

        quantize(model, "int8", torch.float32, FluxFamily.keep_high["denoiser"])
    add_lora(model, FluxFamily().lora_targets("attention"), 4, 4.0, 0.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.train()
    return model


def blocks_of(model: FluxTransformer2DModel) -> list[torch.nn.Module]:
    """The transformer blocks in execution order."""
    return [*model.transformer_blocks, *model.single_transformer_blocks]


def batch() -> dict[str, torch.Tensor]:
    """One input batch: 16 image tokens (an 8x8 latent), 8 text tokens, and a target."""
    gen = torch.Generator().manual_seed(3)
    return dict(hidden_states=torch.randn(1, 16, 16, generator=gen),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
                pooled_projections=torch.randn(1, 32, generator=gen),
                timestep=torch.full((1,), 0.5), img_ids=image_ids(8, 8, CPU, torch.float32),
                txt_ids=torch.zeros(8, 3), target=torch.randn(1, 16, 16, generator=gen))


def step(model: torch.nn.Module, data: dict[str, torch.Tensor], marks: list[str] | None = None
         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward + backward once; returns the output and the LoRA gradients (then cleared)."""
    inputs = {k: v for k, v in data.items() if k != "target"}
    out = model(**inputs, return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(out, data["target"])
    if marks is not None:
        marks.append("backward")
    loss.backward()
    grads = [p.grad.clone() for p in lora_parameters(model)]
    for p in lora_parameters(model):
        p.grad = None
    return out.detach(), grads


def frozen(block: torch.nn.Module) -> list[torch.Tensor]:
    """The frozen parameters of a block, as objects."""
    return [p for p in block.parameters() if not p.requires_grad]


def record(swap: BlockSwap, blocks: list[torch.nn.Module], marks: list[str]
           ) -> list[tuple[str, int, list[int]]]:
    """Log (phase, block, loaded blocks) at every block's pre-hook (runs after the swapper's)."""
    log: list[tuple[str, int, list[int]]] = []

    def hook(i: int) -> Any:
        return lambda _m, _a: log.append((marks[-1], i, swap.loaded()))

    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(hook(i))
    return log


@pytest.mark.parametrize("checkpointing", [False, True])
def test_same_output_and_grads_as_without_swap(checkpointing: bool) -> None:
    model, data = build(), batch()
    if checkpointing:
        model.enable_gradient_checkpointing()
    reference = [step(model, data) for _ in range(2)]
    swap = BlockSwap(blocks_of(model), 3, CPU)
    swap.install(model)
    for ref_out, ref_grads in reference:
        out, grads = step(model, data)
        assert torch.equal(out, ref_out)
        assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads, strict=True))
        assert any(g.abs().sum() > 0 for g in grads)
        assert swap.loaded() == []


def test_loads_at_most_two_and_prefetches_backwards_under_checkpointing() -> None:
    model, data = build(), batch()
    model.enable_gradient_checkpointing()
    blocks = blocks_of(model)
    swap = BlockSwap(blocks, 3, CPU)
    swap.install(model)
    hosts = {i: frozen(blocks[i]) for i in SWAPPED}
    marks = ["forward"]
    log = record(swap, blocks, marks)
    for _ in range(2):
        marks.append("forward")
        step(model, data, marks)
        for i in SWAPPED:  # not running: the host objects are back in place
            assert all(a is b for a, b in zip(frozen(blocks[i]), hosts[i], strict=True))
        assert swap.loaded() == []
    for phase, i, loaded in log:
        assert len(loaded) <= 2
        assert i not in SWAPPED or i in loaded
        ahead = i + 1 if phase == "forward" else i - 1
        if ahead in SWAPPED:
            assert ahead in loaded, (phase, i, loaded)  # prefetched in the running direction
    backward = [i for phase, i, _ in log if phase == "backward"]
    assert backward == [4, 3, 2, 1, 0] * 2  # checkpoint recomputes the blocks in reverse


def test_lora_parameters_keep_identity_and_train_as_without_swap() -> None:
    plain, swapped, data = build(), build(), batch()
    for model in (plain, swapped):
        model.enable_gradient_checkpointing()
    before = lora_parameters(swapped)
    BlockSwap(blocks_of(swapped), 3, CPU).install(swapped)
    assert all(a is b for a, b in zip(lora_parameters(swapped), before, strict=True))
    opts = [torch.optim.AdamW(lora_parameters(m), lr=1e-2) for m in (plain, swapped)]
    inputs = {k: v for k, v in data.items() if k != "target"}
    for _ in range(2):
        for model, opt in zip((plain, swapped), opts):
            out = model(**inputs, return_dict=False)[0]
            torch.nn.functional.mse_loss(out, data["target"]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    pairs = zip(lora_parameters(plain), lora_parameters(swapped), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert all(a is b for a, b in zip(lora_parameters(swapped), before, strict=True))


def test_no_grad_forward_matches() -> None:
    model, data = build(), batch()
    inputs = {k: v for k, v in data.items() if k != "target"}
    with torch.no_grad():
        reference = [model(**inputs, return_dict=False)[0] for _ in range(2)]
        swap = BlockSwap(blocks_of(model), 4, CPU)
        swap.install(model)
        for ref in reference:
            assert torch.equal(model(**inputs, return_dict=False)[0], ref)
            assert swap.loaded() == []


@pytest.mark.parametrize("base", ["fp8", "int8"])
def test_low_bit_weights_swap_and_restore(base: str) -> None:
    if base == "int8":
        pytest.importorskip("torchao")
    model, data = build(base), batch()
    model.enable_gradient_checkpointing()
    reference = step(model, data)
    blocks = blocks_of(model)
    swap = BlockSwap(blocks, 3, CPU)
    swap.install(model)
    weight = blocks[3].attn.to_q.base_layer  # a frozen low-bit Linear in a swapped block
    host = weight.weight
    seen: list[tuple[bool, torch.dtype, type]] = []
    weight.register_forward_pre_hook(
        lambda m, _a: seen.append((m.weight is host, m.weight.dtype, type(m.weight))))
    out, grads = step(model, data)
    assert torch.equal(out, reference[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, reference[1], strict=True))
    assert seen and all(not is_host for is_host, _, _ in seen)  # ran on the swapped-in copy
    assert all(dtype == host.dtype and kind is type(host) for _, dtype, kind in seen)
    if base == "fp8":
        assert host.dtype == torch.float8_e4m3fn
    assert weight.weight is host and swap.loaded() == []


def test_count_out_of_range_names_the_range() -> None:
    blocks = blocks_of(build())
    for count in (-1, 6):
        with pytest.raises(ValueError, match="between 0 and 5"):
            BlockSwap(blocks, count, CPU)
    BlockSwap(blocks, 0, CPU).install(torch.nn.ModuleList(blocks))
    BlockSwap(blocks, 5, CPU)


def test_remove_takes_the_hooks_off() -> None:
    model, data = build(), batch()
    model.enable_gradient_checkpointing()
    blocks = blocks_of(model)
    reference = step(model, data)
    counts = [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in blocks]
    swap = BlockSwap(blocks, 3, CPU)
    swap.install(model)
    step(model, data)
    swap.remove()
    assert [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in blocks] == counts
    calls: list[int] = []
    swap._load = lambda i: calls.append(i)  # type: ignore[method-assign]
    out, grads = step(model, data)
    assert torch.equal(out, reference[0])
    assert all(torch.equal(g, r) for g, r in zip(grads, reference[1], strict=True))
    assert calls == [] and swap.loaded() == []
