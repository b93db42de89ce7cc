"""`difftune check`: everything a run would do short of training, reported in lines: the
data and its buckets, captions and their augmentations, the LoRA layout, gradient flow, sampling."""

from __future__ import annotations

import logging
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from difftune import families
from difftune.adapters import coverage
from difftune.data import class_images
from difftune.adapters.full import trained_parameters
from difftune.adapters.kinds import (adapter_parameters, is_adapter_parameter, kind,
                                     uses_lycoris_layout)
from difftune.config import RunConfig, SaveConfig
from difftune.data import mask_report
from difftune.data.discover import DataSet
from difftune.errors import ConfigError, DataError
from difftune.files.names import COMFYUI_DORA
from difftune.lora_tools.programs import comfyui_loads_nothing
from difftune.verbs.dataset_report import check_summary
from difftune.families.base import blocks_of, start_encoders
from difftune.families.common.experts import Experts
from difftune.memory import clips, estimate, savers
from difftune.train.checkpoint import CheckpointManager
from difftune.train.checkpoint.lora import lora_format
from difftune.train.init_lora import load_init_lora
from difftune.train.loop import param_groups
from difftune.train.optimizers.specs import OPTIMIZERS, parse_args, state_bytes
from difftune.train.rundir import RunLock, refuse_overwrite
from difftune.train.setup import Run, load_data, prepare, set_training
from difftune.report import metric_worker
from difftune.report.metric_worker import training_images
from difftune.report.vae_copies import make_copies
from difftune.train import validation
from difftune.train.step import batch_loss
from difftune.verbs.common import sampler_for

log = logging.getLogger("difftune")


def describe_captions(run: Run) -> list[str]:
    """How each subset's caption augmentations reach the model (printed by check and cache)."""
    seen: dict[tuple[int, int], int] = {}
    for i, item in enumerate(run.data.items):
        seen.setdefault((item.dataset, item.subset), i)
    lines = []
    for (d, s), i in sorted(seen.items()):
        words = run.captions.describe(i)
        if not words:
            continue
        live = ""
        if run.embeddings is not None and any(
                e.name in run.captions.text(i, None, 0) for e in run.cfg.adapter.embeddings):
            live = ("; captions with a learned placeholder are encoded live by the encoders "
                    "learning it")
        lines.append(f"captions of datasets[{d}].subsets[{s}]: {', '.join(words)}; "
                     + _caption_mode(run, i) + live)
    return lines


def _caption_mode(run: Run, index: int) -> str:
    """Whether an item's augmented captions are cached, pre-encoded as variants, or live."""
    cache, k = run.cfg.cache, run.cfg.cache.caption_variants
    item = run.data.items[index]
    random_part = item.augment.is_random(item.augment.fixed(item.caption))
    if cache.text == "none":
        return "text encoded every step (cache.text = \"none\")" + (
            f", {k} variants per caption" if random_part and k else "")
    if random_part and k:
        return f"{k} variants per caption pre-encoded from the seed (cache.caption_variants)"
    if random_part:
        return ("a fresh draw per sample, encoded on demand with the cache as a memo; the "
                "text encoders stay resident (set cache.caption_variants = K to pre-encode)")
    return "every text it can produce is pre-encoded and cached"


def _describe_data(data: DataSet) -> list[str]:
    """The dataset summary lines `check` prints: counts, buckets, each skipped file and why."""
    s = data.summary()
    lines = [f"dataset: {s['images']} images, {s['skipped']} skipped, "
             f"{s['captions_missing']} without caption"]
    if "pairs" in s:
        refs = sorted({len(it.controls) for it in data.items if it.controls})
        lines.append(f"edit pairs: {s['pairs']} complete ({'/'.join(map(str, refs))} control "
                     "image(s) each)")
        sizes = Counter(size for it in data.items for size in it.control_sizes)
        lines += [f"  control size {w}x{h}: {n}" for (w, h), n in sorted(sizes.items())]
    if "resolutions" in s:
        lines += _resolution_lines(s["resolutions"])
    else:
        lines += [f"  bucket {b}: {n}" for b, n in sorted(s["buckets"].items())]
    lines += mask_report.describe(data.items)
    if "clips" in s:
        lines.append(f"  clips: {s['clips']} from {s['videos']} video(s), buckets "
                     "WxHxframes")
    lines += [f"  {note}" for note in data.notes]
    lines += [f"  skipped {p}: {why}" for p, why in data.skipped]
    return lines


def _resolution_lines(sides: dict[str, dict]) -> list[str]:
    """Per resolution of a multi-resolution run: its items, upscaled ones and buckets."""
    lines = []
    for side, s in sorted(sides.items(), key=lambda kv: int(kv[0])):
        clips = f", {s['clips']} clips" if "clips" in s else ""
        lines.append(f"  resolution {side}: {s['images']} images{clips}, {s['upscaled']} "
                     "upscaled")
        lines += [f"    bucket {b}: {n}" for b, n in s["buckets"].items()]
    return lines


def run_check(cfg: RunConfig, init_lora: Path | None = None) -> list[str]:
    """`difftune check`: everything a run does, once, at the smallest size (from `init_lora`'s
    weights, read as `train --init-lora` reads them, where given); returns the report."""
    report = ["config: valid"]
    refuse_overwrite(cfg)
    if cfg.save.dir.is_dir():
        RunLock(cfg.save.dir).acquire().release()  # raises while another run holds it
    report.append(f"output folder: {cfg.save.dir} (nothing would be overwritten)")
    data = load_data(cfg, families.get(cfg.model.family, cfg.model.variant))
    report += _describe_data(data)
    report += check_summary(cfg)
    report += class_images.describe(cfg)
    run = prepare(cfg, dataset=data, show_progress=False, class_images_too=False)
    report.append(f"model: {run.comps.name} loaded on {run.policy.device}")
    report.append(_adapter_line(run))
    report.append(_parameter_line(run))
    report.append(optimizer_line(run))
    report.append(savers.describe(cfg, run.family, run.comps.denoiser))
    report += memory_lines(run)
    report += _expert_lines(run)
    if init_lora is not None:
        load_init_lora(init_lora, CheckpointManager(cfg, run.family, run.comps, run.targets,
                                                    {}, run.embeddings, writes=False))
        report.append(f"--init-lora {init_lora}: read into the trained modules")
    if cfg.adapter.peft_kind is not None:
        report.append(_format_line(run))
    areas = [it.bucket[0] * it.bucket[1] for it in data.items]
    smallest = areas.index(min(areas))
    gen = torch.Generator("cpu").manual_seed(cfg.train.seed)
    set_training(run, True)
    loss = batch_loss(run, [smallest], [False], gen)
    if loss is None:
        raise DataError(f"{data.items[smallest].path} cannot be read (see the warning above); "
                        "replace or remove it")
    if loss.requires_grad:  # false only when nothing trained is used (a caption without
        loss.backward()     # the placeholder of a textual-inversion run)
    value = float(loss.detach())
    if not torch.isfinite(loss):
        raise RuntimeError(f"the check step gave a non-finite loss ({value})")
    caption = run.captions.text(smallest, None, 0)
    flow = _gradient_flow(run, caption)
    report.append(f"training step: loss {value:.4f}, gradients flow into "
                  + (", ".join(flow) if flow else "nothing this step trains (its caption "
                     "uses no placeholder)"))
    report += validation.describe(run)
    assert cfg.cache.dir is not None  # set when the config loads
    training = training_images(data.items)
    copies = make_copies(run, training) if cfg.metrics.enabled else None
    report += metric_worker.describe(cfg.metrics, training, cfg.cache.dir, copies)
    report += _placeholder_report(run)
    report += describe_captions(run)
    report += _check_sample(run)
    return report


def _amount(n: int) -> str:
    """A parameter count in words users compare model sizes by (20.43 B, 1.2 M)."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _parameter_line(run: Run) -> str:
    """The loaded model's parameter counts (the base weights, LoRA factors apart), so a user
    sees which model and size was really loaded, and what the run trains."""
    def base(module: torch.nn.Module) -> int:
        return sum(p.numel() for n, p in module.named_parameters()
                   if not is_adapter_parameter(n))

    parts = [f"denoiser {_amount(base(run.comps.denoiser))}"]
    parts += [f"text encoder {name} {_amount(base(m))}"
              for name, m in run.comps.text_encoders.items() if m is not None]
    parts.append(f"VAE {_amount(base(run.comps.vae))}")
    parts += [f"{name.replace('_', ' ')} {_amount(base(m))}"
              for name, m in run.comps.extras.items() if isinstance(m, torch.nn.Module)]
    trained = sum(p.numel() for m in [run.comps.denoiser, *run.trained_encoders.values()]
                  for p in m.parameters() if p.requires_grad)
    return f"parameters: {', '.join(parts)}; {_amount(trained)} trained"


def memory_lines(run: Run) -> list[str]:
    """The estimated GPU peak of this run and what it needs on 24/16/12 GiB cards: the same
    estimate the web app's presets and the README's table use, from the loaded model's
    parameter counts (memory/estimate.py); for a run of clips, the longest clip's tokens and
    what fits it on each card (memory/clips.py)."""
    spec = run.family.spec
    counts = [_base_count(m) for m in (_on_device(run), *run.comps.text_encoders.values(),
                                       *start_encoders(run.comps)) if m is not None]
    layers = len(blocks_of(run.comps.denoiser, spec.swap_blocks)) if spec.swap_blocks else None
    size = estimate.counted(spec, counts[0] / 1e9, sum(counts[1:]) / 1e9, layers)
    trained = sum(p.numel() for g in param_groups(run) for p in g["params"]) / 1e9
    values = estimate.flatten(run.cfg.model_dump(mode="json"))
    frames = [it.clip.frames for it in run.data.items if it.clip is not None]
    # the longest clip decides the peak (1 in a run of images, whatever `frames` says)
    values[estimate.CLIP_FRAMES] = max(frames, default=1)
    setup = estimate.Setup.from_values(values, trained)
    line = (f"{estimate.estimate(size, spec, setup).describe(setup)}; "
            f"{estimate.advice(size, spec, values, trained)} (sizes: {size.name})")
    return [line] + ([clips.clip_line(values, size, spec, trained)] if frames else [])


def _base_count(module: torch.nn.Module) -> int:
    """A module's base parameters (its LoRA factors apart)."""
    return sum(p.numel() for n, p in module.named_parameters() if not is_adapter_parameter(n))


def _on_device(run: Run) -> torch.nn.Module:
    """The denoiser the accelerator holds at a time: a two-expert model's larger expert."""
    den = run.comps.denoiser
    if not isinstance(den, Experts):
        return den
    return max((den.expert(den.high), den.expert(den.low)), key=_base_count)


def _expert_lines(run: Run) -> list[str]:
    """A two-expert model's plan: which expert trains which timesteps, the alternation, and
    the experts' memory (one on the accelerator at a time, the other in host memory)."""
    if run.turns is None:
        return []
    den = run.comps.denoiser
    assert isinstance(den, Experts)
    idle = min((den.expert(den.high), den.expert(den.low)), key=_base_count)
    host = sum(p.numel() * p.element_size() for n, p in idle.named_parameters()
               if not is_adapter_parameter(n))
    return run.turns.describe() + [
        f"experts: two of {_amount(_base_count(_on_device(run)))} parameters; the memory "
        f"estimate above holds one, the idle one waits in host memory ({_bytes(host)} "
        f"as stored) and moves in when its turn or a sample needs it"]


def _adapter_line(run: Run) -> str:
    """The adapter kind, its options and its trainable parameter count (denoiser and text
    encoders), so a user sees what a LoKr factor or a DoRA magnitude costs."""
    a = run.cfg.adapter
    if a.type == "full":
        count = sum(p.numel() for m in [run.comps.denoiser, *run.trained_encoders.values()]
                    for p in trained_parameters(m, "full"))
        encoders = f" and text encoders {', '.join(run.text_targets)}" if run.text_targets else ""
        return (f"adapter: full fine-tune of {len(run.targets)} denoiser tensors{encoders}: "
                f"{_amount(count)} trainable parameters")
    if a.peft_kind is None:
        return f"adapter: {a.type} (no denoiser adapter)"
    modules = [run.comps.denoiser, *run.trained_encoders.values()]
    count = sum(p.numel() for m in modules for p in adapter_parameters(m))
    name = kind(a.peft_kind).label
    options = ["full-rank" if a.full_matrix else f"rank {a.rank}"]
    options += [f"factor {a.factor}"] if a.type == "lokr" and a.factor != -1 else []
    options += ["decompose_both"] if a.decompose_both else []
    options += [f"conv rank {a.conv_rank}"] if a.conv_rank is not None else []
    encoders = f" and text encoders {', '.join(run.text_targets)}" if run.text_targets else ""
    return (f"adapter: {name}{' (DoRA)' if a.dora else ''}, {', '.join(options)}, on "
            f"{len(run.targets)} denoiser layers{encoders}: {_amount(count)} trainable "
            "parameters")


def _bytes(n: float) -> str:
    """A size in binary units (1.50 GiB, 120.0 KiB)."""
    for size, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def optimizer_line(run: Run) -> str:
    """The optimizer, how the lr schedule reaches it, and the memory its state will take for
    the parameters this run trains (estimated from how its library stores state)."""
    t = run.cfg.train
    spec, args = OPTIMIZERS[t.optimizer], parse_args(t.optimizer, t.optimizer_args)
    params = [p for g in param_groups(run) for p in g["params"]]
    size = params[0].element_size() if params else 4
    total = state_bytes(t.optimizer, args, [tuple(p.shape) for p in params], size)
    count = sum(p.numel() for p in params)
    rule = {"full": "the lr schedule applies",
            "own_warmup": "no lr schedule (its own warm-up: train.warmup_steps)",
            "none": "its own relative step size (train.lr not used)"}[spec.schedule(args)]
    each = f" ({total / count:.1f} bytes per parameter)" if count else ""
    return (f"optimizer: {t.optimizer} ({spec.library}); state about {_bytes(total)} "
            f"for {_amount(count)} trained parameters{each}; {rule}")


def _format_line(run: Run) -> str:
    """Which key layout the LoRA will be written in, and why."""
    a, save = run.cfg.adapter, run.cfg.save
    lycoris = uses_lycoris_layout(a.type, a.dora)
    fmt = coverage.LYCORIS if lycoris else lora_format(save, run.family)
    gaps = coverage.describe(run.family, fmt, run.targets)
    if lycoris:
        return (f"adapter file format: LyCORIS ({run.family.lycoris_prefix}_<module>, "
                "lora_teN_<module>), read by ComfyUI and the LyCORIS tools"
                + (f"; {_dora_files(run.cfg.save)}" if a.dora else "")
                + (f"; WARNING: {gaps}" if gaps else ""))
    if gaps:
        why = f"{'set by save.format' if save.format else 'the default'}; WARNING: {gaps}"
    else:
        absent = comfyui_loads_nothing(run.family.name)
        readers = (f"diffusers reads fully ({absent})" if absent
                   else "ComfyUI and diffusers both read fully")
        why = ("set by save.format" if save.format else f"the {run.family.name} default: "
               f"the layout {readers}; set save.format to choose")
    return f"LoRA file format: {fmt} ({why})"


def _dora_files(save: SaveConfig) -> str:
    """Which DoRA file to load where: ComfyUI and Forge divide the magnitudes by the base
    weight's norm, peft and LyCORIS by the adapted weight's (adapters/dora_comfyui.py)."""
    name = save.name
    if not save.dora_comfyui:
        return (f"DoRA: {name}.safetensors for diffusers/peft, LyCORIS and difftune; ComfyUI and "
                "Forge read its magnitudes by another formula (rows off by ||W+dW||/||W||): "
                "set save.dora_comfyui = true for a file of their own")
    return (f"DoRA: load {name}.safetensors in diffusers/peft, LyCORIS and difftune, and "
            f"{name}{COMFYUI_DORA}.safetensors in ComfyUI and Forge (magnitudes for their "
            "formula, which divides by the base weight's norm)")


def _gradient_flow(run: Run, caption: str) -> list[str]:
    """What got a gradient in the check step (LoRAs, and embeddings `caption` uses); raises
    if one got none."""
    groups: dict[str, list[torch.nn.Parameter]] = {}
    a = run.cfg.adapter
    if a.peft_kind is not None or a.type == "full":
        groups["the denoiser"] = trained_parameters(run.comps.denoiser, a.type)
    groups |= {f"text encoder {n}": trained_parameters(m, a.type)
               for n, m in run.trained_encoders.items()}
    if run.embeddings is not None:
        for item in run.embeddings.learned:
            if item.spec.name in caption:
                groups[f"{item.spec.name} in {item.encoder}"] = [run.embeddings.tensor_of(item)]
    for label, params in groups.items():
        if not any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params):
            raise RuntimeError(f"the check step gave no gradient in {label}")
    return list(groups)


def _placeholder_report(run: Run) -> list[str]:
    """How many captions use each placeholder (none is a mistake worth seeing in seconds)."""
    if run.embeddings is None:
        return []
    captions = [run.captions.text(i, None, 0) for i in range(len(run.data.items))]
    lines = []
    for spec in run.cfg.adapter.embeddings:
        used = sum(spec.name in c for c in captions)
        lines.append(f"placeholder {spec.name}: in {used} of {len(captions)} captions"
                     + ("" if used else " (none: add it to the captions or caption_prefix, or "
                        "nothing will train it)"))
    return lines


def _check_sample(run: Run) -> list[str]:
    if run.cfg.sample.prompts is None:
        return ["sampling: no prompt file configured (sample.prompts); skipped"]
    runner = sampler_for(run, None, Path())
    specs = runner.prompts()
    step = run.family.bucket_step * 2
    # Two steps: the fewest that run every part of a multi-step schedule.
    probe = [replace(s, width=step, height=step, steps=2) for s in specs[:1]]
    if not probe:
        path = run.cfg.sample.prompts
        what = "holds no usable prompt (the warnings above say why each line was skipped)" \
            if path.is_file() else "does not exist"
        raise ConfigError(f"sample.prompts: {path} {what}; write one prompt a line there, or "
                          "remove sample.prompts to train without samples")
    with tempfile.TemporaryDirectory() as tmp:
        images = runner.run(0, probe, Path(tmp))
        flat = bool(images) and _flat(images[0])
    if not images:
        return ["sampling: FAILED (see the warning above); training would go on without samples"]
    if flat:
        return [f"sampling: FAILED: the 2-step {step}x{step} probe image is one flat colour "
                "(NaN or inf in the pipeline); training would go on with blank samples"]
    return [f"sampling: {len(specs)} prompt(s) read; a 2-step {step}x{step} sample works"]


def _flat(path: Path) -> bool:
    """Whether an image is one single colour (what a NaN latent decodes to)."""
    from PIL import Image

    with Image.open(path) as image:
        low, high = zip(*image.convert("RGB").getextrema())
    return low == high
