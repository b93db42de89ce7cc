"""Per-step overhead of difftune's training loop over a minimal hand-written PyTorch loop.

    python bench/overhead.py [--steps 200] [--warmup 20] [--rounds 3] [--batch 2] [--device cpu]

Both loops train the same tiny-flavor FLUX.1 transformer with the same LoRA (rank 16, all
linear layers), batch and AdamW settings, with gradient clipping. The baseline feeds one fixed,
pre-packed batch straight into the transformer; difftune runs its real loop (bucket sampler,
cache lookups, timestep sampling, packing, autocast policy, metrics.jsonl, TensorBoard, progress
accounting). Seconds per step are measured after a warm-up, rounds alternate between the two,
and the ratio of medians and the median of per-round ratios are printed.
Goal: overhead <= 5%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from difftune.adapters.lora import lora_parameters
from difftune.config import RunConfig, parse_config
from difftune.verbs.demo import demo_dir
from difftune.families.common.latents import image_ids, pack
from difftune.report.metrics import Reporter
from difftune.train.checkpoint import CheckpointManager
from difftune.train.loop import Hooks, train
from difftune.train.optimizers.build import make_optimizer
from difftune.train.setup import fill_caches, prepare


def config(out: Path, steps: int, batch: int, device: str) -> RunConfig:
    """A tiny-flavor run on the bundled demo images, no sampling."""
    return parse_config({
        "model": {"flavor": "tiny"},
        "adapter": {"rank": 16, "targets": "all_linear"},
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128}],
        "train": {"steps": steps, "batch_size": batch, "lr": 1e-4, "device": device,
                  "log_every": 1},
        "sample": {"at_end": False},
        "save": {"dir": str(out), "overwrite": True},
    }, out)


def difftune_step_time(cfg: RunConfig, warmup: int) -> float:
    """Seconds per step of difftune's own loop, from the loop's metrics after warm-up."""
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    reporter = Reporter(cfg.save.dir, cfg.train.steps, bar=False)
    ckpt = CheckpointManager(cfg, run.family, run.comps, run.targets, {})
    try:
        train(run, Hooks(reporter, ckpt, None))
    finally:
        reporter.close()
    rows = [json.loads(l) for l in (cfg.save.dir / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in rows}
    return (times[cfg.train.steps] - times[warmup]) / (cfg.train.steps - warmup)


def baseline_step_time(cfg: RunConfig, warmup: int) -> float:
    """Seconds per step of a hand-written loop on the same model and one fixed batch."""
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    device = run.policy.device
    model = run.comps.denoiser
    params = lora_parameters(model)
    opt = make_optimizer(params, cfg.train)
    n = cfg.train.batch_size
    latents = torch.stack([run.latents.get(i, False) for i in range(n)]).to(device)
    embeds = run.texts.get([it.caption for it in run.data.items[:n]]).to(device)
    noise = torch.randn_like(latents)
    t = torch.full((n,), 0.5, device=device)
    noisy, target = (1 - 0.5) * latents + 0.5 * noise, noise - latents
    h, w = latents.shape[-2:]
    inputs = dict(hidden_states=pack(noisy), encoder_hidden_states=embeds.tensors["prompt_embeds"],
                  pooled_projections=embeds.tensors["pooled_prompt_embeds"], timestep=t,
                  img_ids=image_ids(h, w, device, latents.dtype),
                  txt_ids=torch.zeros(embeds.tensors["prompt_embeds"].shape[1], 3, device=device),
                  guidance=torch.ones(n, device=device), return_dict=False)
    target = pack(target)
    model.train()
    for step in range(cfg.train.steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        pred = model(**inputs)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), target.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss.detach())  # difftune reads the loss every step too
    return (time.perf_counter() - start) / (cfg.train.steps - warmup)


def main(argv: list[str] | None = None) -> int:
    """Run the alternating rounds and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    base, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            cfg = config(Path(tmp) / f"round{r}", args.steps, args.batch, args.device)
            base.append(baseline_step_time(cfg, args.warmup))
            ours.append(difftune_step_time(cfg, args.warmup))
            print(f"round {r}: baseline {base[-1] * 1e3:.2f} ms/step, "
                  f"difftune {ours[-1] * 1e3:.2f} ms/step, ratio {ours[-1] / base[-1]:.3f}",
                  flush=True)
    b, d = statistics.median(base), statistics.median(ours)
    print(f"device {args.device}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"batch {args.batch}, {args.steps - args.warmup} timed steps x {args.rounds} rounds")
    print(f"median baseline {b * 1e3:.2f} ms/step, difftune {d * 1e3:.2f} ms/step, "
          f"ratio {d / b:.3f} (overhead {100 * (d / b - 1):+.1f}%)")
    # Each round measures both loops back to back, so the median of the per-round ratios is
    # the figure least moved by drifting load on the machine.
    paired = statistics.median(o / b for o, b in zip(ours, base))
    print(f"median of per-round ratios {paired:.3f} (overhead {100 * (paired - 1):+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
