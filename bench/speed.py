"""Seconds per step, model FLOP utilization and peak memory of a FLUX.1-dev LoRA step, per
memory saver, on a GPU.

    python bench/speed.py [--resolutions 512,1024] [--steps 8] [--warmup 3] [--swap 50]
                          [--savers plain,compile,checkpointing,swap,adamw8bit,fused]

The transformer has FLUX.1-dev's real config with random bf16 weights (nothing is
downloaded); LoRA rank 16 on every linear layer of the blocks ("all_linear"), batch 1, 512
text tokens, AdamW. Each saver is measured alone against plain bf16 in the same run:

- plain: bf16 weights, autocast bf16, no saver
- compile: torch.compile of every transformer block (difftune's train.compile)
- checkpointing: gradient checkpointing of every block
- swap: checkpointing plus block swap of the last N blocks (train.blocks_to_swap = N)
- adamw8bit: bitsandbytes' 8-bit AdamW
- fused: the fused backward pass (optimizer step per parameter during backward)

FLOP utilization: the issue's figures, a LoRA step at 1024x1024 is about 164 TFLOP without
checkpointing and 238 with, scaled to 512x512 by the forward FLOPs of the two sizes (dense
2 x params x tokens plus attention 4 x layers x tokens^2 x width, 512 text tokens each), over
the GPU's dense bf16 peak. `--smoke` runs a small model on the CPU to check the script only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
                attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
SMOKE = dict(FLUX_DEV, num_layers=2, num_single_layers=3, attention_head_dim=32,
             num_attention_heads=2, joint_attention_dim=64, pooled_projection_dim=32,
             axes_dims_rope=(8, 12, 12))
TFLOP_1024 = {False: 164.0, True: 238.0}  # a LoRA step at 1024x1024, without / with ckpt
PEAK_BF16 = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}
TEXT_TOKENS = 512
SAVERS = ("plain", "compile", "checkpointing", "swap", "adamw8bit", "fused")


@dataclass
class Setup:
    """What one measurement runs on."""

    config: dict[str, Any]
    device: torch.device
    resolution: int
    swap: int


def forward_tflop(config: dict[str, Any], resolution: int) -> float:
    """Forward FLOPs (T) of the transformer blocks for one image: dense plus attention."""
    width = config["attention_head_dim"] * config["num_attention_heads"]
    layers = config["num_layers"] + config["num_single_layers"]
    tokens = (resolution // 16) ** 2 + TEXT_TOKENS
    params = 11.9e9 * (width / 3072) ** 2 * layers / 57  # FLUX.1-dev's blocks: 11.9B
    return (2 * params * tokens + 4 * layers * tokens ** 2 * width) / 1e12


def step_tflop(config: dict[str, Any], resolution: int, checkpointing: bool) -> float:
    """A LoRA step's FLOPs: the issue's 1024x1024 figure, scaled by the forward FLOPs."""
    scale = forward_tflop(config, resolution) / forward_tflop(FLUX_DEV, 1024)
    return TFLOP_1024[checkpointing] * scale


def build(s: Setup, saver: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The transformer with a rank-16 LoRA and `saver` applied, and its optimizer."""
    from diffusers import FluxTransformer2DModel

    from difftune.adapters.lora import add_lora
    from difftune.families.base import blocks_of
    from difftune.families.flux.family import FluxFamily
    from difftune.memory.blockswap import BlockSwap

    home = torch.device("cpu") if saver == "swap" else s.device
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: never 48 GB of fp32 first
    try:
        with torch.device(home):
            model = FluxTransformer2DModel(**s.config)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    add_lora(model, FluxFamily().lora_targets("all_linear"), 16, 16.0, 0.0, seed=0)
    if saver in ("checkpointing", "swap"):
        model.enable_gradient_checkpointing()
    blocks = blocks_of(model, FluxFamily.swap_blocks)
    if saver == "swap":
        BlockSwap(blocks, s.swap, s.device).install(model)
    if saver == "compile":
        for block in blocks:
            block.compile()
    model.train()
    return model, optimizer(model, saver)


def optimizer(model: torch.nn.Module, saver: str) -> torch.optim.Optimizer:
    """AdamW over the LoRA: torch's, bitsandbytes' 8-bit one, or the fused-backward one."""
    params = [p for p in model.parameters() if p.requires_grad]
    if saver == "adamw8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=1e-4)
    if saver == "fused":
        from difftune.memory.fused import FusedAdamW

        opt = FusedAdamW(params, lr=1e-4)
        opt.attach()
        return opt
    return torch.optim.AdamW(params, lr=1e-4)


def inputs(s: Setup) -> dict[str, torch.Tensor]:
    """One packed batch: (resolution/16)^2 image tokens, 512 text tokens, bf16."""
    from difftune.families.common.latents import image_ids

    side, dev, dt, c = s.resolution // 16, s.device, torch.bfloat16, s.config
    return dict(
        hidden_states=torch.randn(1, side * side, c["in_channels"], device=dev, dtype=dt),
        encoder_hidden_states=torch.randn(1, TEXT_TOKENS, c["joint_attention_dim"], device=dev,
                                          dtype=dt),
        pooled_projections=torch.randn(1, c["pooled_projection_dim"], device=dev, dtype=dt),
        timestep=torch.full((1,), 0.5, device=dev), guidance=torch.ones(1, device=dev),
        img_ids=image_ids(side * 2, side * 2, dev, dt),
        txt_ids=torch.zeros(TEXT_TOKENS, 3, device=dev, dtype=dt))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(s: Setup, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
                warmup: int) -> tuple[float, float]:
    """(median seconds per step, peak GiB over the timed steps; 0 on the CPU)."""
    batch = inputs(s)
    target = torch.randn_like(batch["hidden_states"])
    times = []
    for step in range(warmup + steps):
        if step == warmup and s.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(s.device.type, dtype=torch.bfloat16):
            pred = model(**batch, return_dict=False)[0]
        torch.nn.functional.mse_loss(pred.float(), target.float()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(s.device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if s.device.type == "cuda" else 0.0
    return statistics.median(times[warmup:]), peak


def measure(s: Setup, saver: str, steps: int, warmup: int) -> tuple[float, float]:
    """Build, time and free one configuration."""
    model, opt = build(s, saver)
    try:
        return timed_steps(s, model, opt, steps, warmup)
    finally:
        del model, opt
        gc.collect()
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()


def report(s: Setup, saver: str, sec: float, gib: float, base: float | None,
           peak_tflops: float | None) -> str:
    """One printed line: s/step, ratio against plain, MFU, peak memory."""
    ckpt = saver in ("checkpointing", "swap")
    tflop = step_tflop(s.config, s.resolution, ckpt)
    mfu = f", MFU {100 * tflop / sec / peak_tflops:5.1f}%" if peak_tflops else ""
    ratio = f", {sec / base:.2f}x plain" if base else ""
    name = f"swap {s.swap}" if saver == "swap" else saver
    return (f"{s.resolution:5d}px {name:13s}: {sec:.3f} s/step{ratio}{mfu}, "
            f"{tflop:.1f} TFLOP/step, peak {gib:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    """Measure each saver at each resolution; print one line each."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--resolutions", default="512,1024")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--swap", type=int, default=50, help="blocks to swap (of 57)")
    p.add_argument("--savers", default=",".join(SAVERS))
    p.add_argument("--smoke", action="store_true", help="a small model on the CPU")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench/speed.py needs a CUDA device (or --smoke for a CPU check of the script)")
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    name = "CPU (smoke)" if args.smoke else torch.cuda.get_device_name()
    peak = None if args.smoke else next((v for k, v in PEAK_BF16.items() if k in name), None)
    config = SMOKE if args.smoke else FLUX_DEV
    print(f"{name}, torch {torch.__version__}, LoRA rank 16 (all_linear), batch 1, "
          f"{TEXT_TOKENS} text tokens, median of {args.steps} steps after {args.warmup}")
    savers = args.savers.split(",")
    for res in (int(r) for r in args.resolutions.split(",")):
        layers = config["num_layers"] + config["num_single_layers"]
        s = Setup(config, device, res, min(args.swap, layers - 1))
        base = None
        for saver in savers:
            sec, gib = measure(s, saver, args.steps, args.warmup)
            base = sec if saver == "plain" else base
            print(report(s, saver, sec, gib, base if saver != "plain" else None, peak),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
