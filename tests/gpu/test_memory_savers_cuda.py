"""Block swap and the fused backward pass on a CUDA device: less peak memory, same numbers."""

from __future__ import annotations

import gc

import pytest
import torch

from difftune.adapters.lora import add_lora, lora_parameters
from difftune.families.common.latents import image_ids
from difftune.families.flux.family import FluxFamily
from difftune.memory.blockswap import BlockSwap
from difftune.memory.fused import FusedAdamW

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# About 0.5 B parameters (1 GiB in bf16): 8 double and 16 single blocks, width 1024.
MID = dict(patch_size=1, in_channels=64, num_layers=8, num_single_layers=16,
           attention_head_dim=128, num_attention_heads=8, joint_attention_dim=1024,
           pooled_projection_dim=256, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
SIDE, TEXT = 64, 128  # a 64x64 latent: 1024 image tokens; 128 text tokens
CUDA = torch.device("cuda")


def build() -> torch.nn.Module:
    """The transformer in bf16 on the CPU (seeded), frozen, with a fp32 LoRA (B not zero)."""
    from diffusers import FluxTransformer2DModel

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = FluxTransformer2DModel(**MID)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    add_lora(model, FluxFamily().lora_targets("attention"), 16, 16.0, 0.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    model.enable_gradient_checkpointing()
    model.train()
    return model


def inputs() -> dict[str, torch.Tensor]:
    """One batch on the GPU (bf16), and a target."""
    gen = torch.Generator().manual_seed(3)
    tokens = (SIDE // 2) ** 2

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(CUDA, torch.bfloat16)

    return dict(hidden_states=rand(1, tokens, MID["in_channels"]),
                encoder_hidden_states=rand(1, TEXT, MID["joint_attention_dim"]),
                pooled_projections=rand(1, MID["pooled_projection_dim"]),
                timestep=torch.full((1,), 0.5, device=CUDA, dtype=torch.bfloat16),
                img_ids=image_ids(SIDE, SIDE, CUDA, torch.bfloat16),
                txt_ids=torch.zeros(TEXT, 3, device=CUDA, dtype=torch.bfloat16),
                target=rand(1, tokens, MID["in_channels"]))


def run(count: int) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One forward+backward (block swap of `count` blocks, or none): output, grads, peak bytes."""
    model = build()
    swap = None
    if count:
        swap = BlockSwap([*model.transformer_blocks, *model.single_transformer_blocks], count,
                         CUDA)
        swap.install(model)
    else:
        model.to(CUDA)
    data = inputs()
    target = data.pop("target")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(**data, return_dict=False)[0]
    torch.nn.functional.mse_loss(out.float(), target.float()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    result = out.float().cpu(), [p.grad.float().cpu() for p in lora_parameters(model)], peak
    assert swap is None or swap.loaded() == []
    del model, swap, data, out
    gc.collect()
    torch.cuda.empty_cache()
    return result


def close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    """Relative error in norm below `tol`."""
    return float((a - b).norm()) <= tol * float(b.norm()) + 1e-12


def test_block_swap_lowers_peak_memory_with_same_results() -> None:
    ref_out, ref_grads, ref_peak = run(0)
    out, grads, peak = run(22)  # 22 of 24 blocks swapped
    assert peak < 0.6 * ref_peak, (peak / 2**20, ref_peak / 2**20)
    assert close(out, ref_out, 1e-2)
    assert all(close(g, r, 2e-2) for g, r in zip(grads, ref_grads, strict=True))
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_fused_adamw_matches_adamw_on_cuda() -> None:
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                  torch.nn.Linear(256, 64)).to(CUDA) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    settings = dict(lr=1e-3, weight_decay=0.01)
    opts = [torch.optim.AdamW(models[0].parameters(), **settings),
            FusedAdamW(models[1].parameters(), **settings)]
    opts[1].attach()
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]
    gen = torch.Generator(device=CUDA).manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 64, device=CUDA, generator=gen)
        for model, opt, sched in zip(models, opts, scheds):
            model(x).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in models[1].parameters())
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
