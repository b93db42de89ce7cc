"""The precision matrix on the tiny flavors, CPU: family (every registered one) x mixed x base x text caching
x a text encoder trained (the family's first one
whose LoRA can be saved; where none can, the refusal is asserted). Each supported cell trains one step (finite loss), samples one image, saves the
LoRA and reads it back (only LoRA tensors, equal to the trained ones: no quantizer names leak);
each unsupported cell is refused when the config loads, with the message asserted.

Tiers: the default run executes a fixed subset of the cells (`tiers`; the cells number
families x 3 x 4 x 2 x 2): the all-pairs cover (`conftest.pairwise`: every pair of values of any
two axes in some cell; chosen greedily in `CELLS` order, so it never changes between runs) of
the supported cells with a low-precision base ("half", "fp8", "int8": how the family's own
modules are stored, cast or quantized, a family fact), so every family runs each of those bases
and each mixed precision; the fp32 base ("full", every family's plain path, which the contract
suite runs for each) with each mixed precision, caching and trained value, and the refusals
(a config check the same for every family), on the first family only. The other cells are
`full_only` and run with `pytest --full`."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from difftune import families
from difftune.adapters.formats import with_clip_root
from difftune.adapters.lora import lora_state
from difftune.config import parse_config
from difftune.verbs.demo import demo_dir
from difftune.errors import ConfigError
from difftune.families.common.text import file_clip_roots
from difftune.precision.lowbit import Fp8Linear
from difftune.report.metrics import Reporter
from difftune.sample.runner import SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.loop import Hooks, train
from difftune.train.setup import fill_caches, prepare

from .conftest import pairwise

# "half": every part stored in the mixed dtype (fp16 or bf16), the common set-up on a GPU.
BASES = {"full": {}, "half": {}, "fp8": {"denoiser": "fp8", "text_encoders": "fp8", "vae": "fp8"},
         "int8": {"quantize": {"denoiser": "int8", "text_encoders": "int8"}},
         "nf4": {"quantize": {"denoiser": "nf4", "text_encoders": "nf4"}}}  # CUDA only
CELLS = list(itertools.product(families.names(), ("no", "fp16", "bf16"),
                               ("full", "half", "fp8", "int8"), ("memory", "none"), (False, True)))




def trained_encoder(family: str) -> tuple[str, str | None]:
    """The family's first text encoder whose LoRA can be saved (and None), else its first one
    and the reason its LoRA is refused (from the spec)."""
    spec = families.spec(family)
    refused = dict(spec.text_encoder_lora_refused)
    names = [e.name for e in spec.text_encoders]
    name = next((n for n in names if n not in refused), names[0])
    return name, refused.get(name)


def unsupported(mixed: str, base: str) -> str | None:
    """The message a cell is refused with, or None when it is supported."""
    if base in ("fp8", "half") and mixed == "no":
        return 'needs precision.mixed = "bf16" or "fp16"'
    return None


def config(tmp: Path, family: str, mixed: str, base: str, text: str, trained: bool,
           device: str = "cpu") -> object:
    spec = families.spec(family)
    step = max(32, spec.bucket_step)
    prompts = tmp / "p.txt"
    prompts.write_text(f"a red circle --w {step} --h {step} --s 1 --l 2 --n blurry\n")
    return parse_config({
        "model": {"family": family, "flavor": "tiny"},
        "precision": {"mixed": mixed, **BASES[base], **(
            {p: mixed if mixed != "no" else "fp16" for p in ("denoiser", "text_encoders", "vae")}
            if base == "half" else {})},
        "adapter": {"rank": 2, "targets": "attention",
                    "text_encoders": [trained_encoder(family)[0]] if trained else []},
        "datasets": [{"path": str(demo_dir()), "resolution": 64, "min_side": 32,
                      "max_side": 128, "buckets": False}],
        "cache": {"text": text},
        "train": {"steps": 1, "batch_size": 1, "lr": 1e-3, "device": device},
        "sample": {"prompts": str(prompts), "at_end": True},
        # The diffusers layout: its keys are the modules' own (CLIP under text_model.).
        "save": {"dir": str(tmp / "out"), "dtype": "fp32", "format": "diffusers"},
    }, tmp)


def tiers(cells: list[tuple]) -> list[Any]:
    """`cells` as parametrize values, the default subset the module docstring states kept,
    the others `full_only`."""
    first = families.names()[0]
    keep = pairwise([c for c in cells if c[2] != "full" and not unsupported(c[1], c[2])])
    own = [c for c in cells if c[0] == first]
    keep += pairwise([c for c in own if c[2] == "full"], skip=((1, 3), (1, 4), (3, 4)),
                     ignore=(0,))
    keep += [next(c for c in own if unsupported(c[1], c[2]) and c[2] == base)
             for base in ("half", "fp8")]
    return [c if c in keep else pytest.param(*c, marks=pytest.mark.full_only) for c in cells]


@pytest.mark.parametrize("family, mixed, base, text, trained", tiers(CELLS))
def test_cell(tmp_path: Path, family: str, mixed: str, base: str, text: str,
              trained: bool) -> None:
    check_cell(tmp_path, family, mixed, base, text, trained, "cpu")


def check_cell(tmp_path: Path, family: str, mixed: str, base: str, text: str, trained: bool,
               device: str) -> None:
    """One cell on `device`: refused with its message, or one step, one sample, the LoRA."""
    refused = unsupported(mixed, base) or (trained and trained_encoder(family)[1])
    if refused:
        with pytest.raises(ConfigError, match=refused):
            config(tmp_path, family, mixed, base, text, trained, device)
        return
    cfg = config(tmp_path, family, mixed, base, text, trained, device)
    run = prepare(cfg, show_progress=False)
    low = [m for m in run.comps.denoiser.modules() if isinstance(m, Fp8Linear)
           or type(getattr(m, "weight", None)).__name__ == "Int8Tensor"]
    assert bool(low) == (base in ("fp8", "int8")) or base == "nf4"  # really low-bit
    fill_caches(run, ["a red circle", "blurry"], show_progress=False)
    reporter = Reporter(cfg.save.dir, 1, bar=False)
    sampler = SampleRunner(run.family, run.comps, run.texts, cfg.sample, cfg.save.dir / "samples",
                           (64, 64), run.policy)
    ckpt = CheckpointManager(cfg, run.family, run.comps, run.targets, {})
    try:
        result = train(run, Hooks(reporter, ckpt, sampler))
    finally:
        reporter.close()
    assert len(result.losses) == 1 and torch.isfinite(torch.tensor(result.losses[0]))
    trainable = [p for m in (run.comps.denoiser, *run.trained_encoders.values())
                 for p in m.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)  # LoRA stays fp32
    assert list((cfg.save.dir / "samples").glob("step-000001_00_*.png")), "no sample"
    saved = load_file(str(result.lora))
    ours = lora_state(run.comps.denoiser, run.family.denoiser_prefix)
    if trained:
        name = trained_encoder(family)[0]
        ours |= lora_state(run.comps.text_encoders[name], run.family.text_encoder_prefixes[name])
    ours = with_clip_root(ours, file_clip_roots(run.family))  # alpha = rank: nothing folded
    assert set(saved) == set(ours) and all(".lora_" in k for k in saved)
    for key, value in ours.items():
        assert torch.equal(saved[key], value.float().cpu()), key
