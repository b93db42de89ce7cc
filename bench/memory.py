"""Peak memory and seconds per step of a FLUX.1-dev-sized LoRA step on a GPU, per precision.

    python bench/memory.py [--steps 8] [--warmup 3] [--resolution 1024] [--bases bf16,fp8,int8]

The transformer has FLUX.1-dev's real config with random weights (nothing is downloaded); LoRA
rank 16 on the attention preset, batch 1, 512 text tokens. For each base (bf16 weights, fp8
storage, torchao int8 weight-only) and with / without gradient checkpointing it prints seconds
per step (median after warm-up), model FLOP utilization against the GPU's dense bf16 peak
(a step at 1024x1024 is about 164 TFLOP without checkpointing and 238 with, from the issue),
and the peak memory of the training step. Needs CUDA.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
TFLOP_1024 = {False: 164.0, True: 238.0}  # per step at 1024x1024, without / with checkpointing
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense bf16 TFLOP/s
DEVICE = "cuda"  # a smoke test on the CPU sets "cpu" and a smaller FLUX_DEV


def build(base: str, checkpointing: bool) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """The transformer on the GPU in `base` precision, with a rank-16 LoRA (fp32)."""
    from diffusers import FluxTransformer2DModel

    from difftune.adapters.lora import add_lora
    from difftune.families.flux.family import FluxFamily
    from difftune.precision.lowbit import quantize, store_fp8

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 24 GB, never 48 GB of fp32 first
    try:
        with torch.device(DEVICE):
            model = FluxTransformer2DModel(**FLUX_DEV)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    keep = FluxFamily.keep_high["denoiser"]
    if base == "fp8":
        store_fp8(model, torch.bfloat16, keep)
    elif base == "int8":
        quantize(model, "int8", torch.bfloat16, keep)
    add_lora(model, FluxFamily().lora_targets("attention"), 16, 16.0, 0.0, seed=0)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, params


def inputs(resolution: int) -> dict[str, torch.Tensor]:
    """One packed batch: 4096 image tokens at 1024x1024, 512 text tokens."""
    from difftune.families.common.latents import image_ids

    side = resolution // 16  # VAE /8, then 2x2 packing
    dev, dt = torch.device(DEVICE), torch.bfloat16
    return dict(hidden_states=torch.randn(1, side * side, FLUX_DEV["in_channels"], device=dev,
                                          dtype=dt),
                encoder_hidden_states=torch.randn(1, 512, FLUX_DEV["joint_attention_dim"],
                                                  device=dev, dtype=dt),
                pooled_projections=torch.randn(1, FLUX_DEV["pooled_projection_dim"], device=dev,
                                               dtype=dt),
                timestep=torch.full((1,), 0.5, device=dev), guidance=torch.ones(1, device=dev),
                img_ids=image_ids(side * 2, side * 2, dev, dt),
                txt_ids=torch.zeros(512, 3, device=dev, dtype=dt))


def measure(base: str, checkpointing: bool, resolution: int, steps: int,
            warmup: int) -> tuple[float, float]:
    """(median seconds per step, peak GiB of the training steps)."""
    model, params = build(base, checkpointing)
    opt = torch.optim.AdamW(params, lr=1e-4)
    batch = inputs(resolution)
    target = torch.randn_like(batch["hidden_states"])
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = model(**batch, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt, batch, params
    gc.collect()
    torch.cuda.empty_cache()
    return statistics.median(times[warmup:]), peak


def main(argv: list[str] | None = None) -> int:
    """Measure every base with and without checkpointing; print one line each."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--bases", default="bf16,fp8,int8")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/memory.py needs a CUDA device")
        return 2
    name = torch.cuda.get_device_name()
    peak_tflops = next((v for k, v in PEAK_BF16.items() if k in name), None)
    print(f"{name}, torch {torch.__version__}, {args.resolution}x{args.resolution}, LoRA rank 16 "
          f"(attention), batch 1, 512 text tokens, {args.steps} timed steps")
    scale = (args.resolution / 1024) ** 2  # image tokens dominate; a rough figure off 1024
    for base in args.bases.split(","):
        for ckpt in (False, True):
            sec, gib = measure(base, ckpt, args.resolution, args.steps, args.warmup)
            mfu = (f", MFU {100 * TFLOP_1024[ckpt] * scale / sec / peak_tflops:.1f}%"
                   if peak_tflops else "")
            print(f"{base:5s} checkpointing={'on ' if ckpt else 'off'}: {sec:.3f} s/step, "
                  f"peak {gib:.1f} GiB{mfu}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
