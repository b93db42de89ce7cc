"""Presets per example and GPU memory (24, 16 and 12 GiB), made from the example configs.

Each example in `examples/` states its sizes in its header (`# Sizes ...: denoiser 11.90 B (57
blocks), text encoders 4.88 B, on a 24 GB GPU.`). The preset for that GPU is the example; a
smaller card gets the example plus the memory savers the project offers, chosen by arithmetic
on those parameter counts (an estimate, not a measurement), in this order until it fits:

- training holds the denoiser's resident weights (2 bytes a parameter in bf16/fp16, 1 in fp8
  or int8, 0.5 in nf4, 4 in fp32), the LoRA (about 0.5% of the denoiser's parameters, as the
  README counts for Qwen-Image's rank-16 `attention_mlp`; fp32 weight and gradient plus 8 bytes
  of AdamW state, 2 with `adamw8bit`) and a 3 GiB reserve for activations with gradient
  checkpointing and the CUDA context; the text encoders are cached first and offloaded
  (`cache.offload`), so they need to fit alone, with 1 GiB to spare, while captions are encoded;
- savers, in order: `train.gradient_checkpointing`; an int8 denoiser
  (`precision.quantize.denoiser`); `train.optimizer = "adamw8bit"`; `train.blocks_to_swap` =
  the fewest blocks that fit (blocks taken as equal in size, two in flight), where the family
  can swap blocks and the header gives their count; for the caching phase, int8 text encoders
  (`precision.quantize.text_encoders`) and `cache.unload_text_encoders`.

Where even all of them do not fit, there is no preset (`refused` says why). A full fine-tune's
example gets its own GPU size only: its trained weights are not what these savers shrink.
Every preset writes its outputs next to the run file (`save.dir = "."`), where the app saves
it. The tiny FLUX.1 preset (`tiny-lora.toml`, CPU) points its dataset and prompts at the demo
images bundled with the package.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from difftune.config.sections import ModelConfig
from difftune.families import registry
from difftune.ui.forms import toml_io

# The family a run file without `model.family` gets (the config model's default).
DEFAULT_FAMILY: str = ModelConfig.model_fields["family"].default

GIB = 2 ** 30
SIZES = (24, 16, 12)
RESERVE_GIB = 3.0  # activations with gradient checkpointing, CUDA context, fragmentation
ENCODE_RESERVE_GIB = 1.0  # encoding captions: the encoders' own activations
LORA_SHARE = 0.005  # LoRA parameters per denoiser parameter (rank 16, attention_mlp)
_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "qint8": 1, "qfloat8": 1,
          "nf4": 0.5}
_SIZES = re.compile(r"^# Sizes[^:]*: denoiser ([\d.]+) B(?: \((\d+) blocks\))?, text encoders "
                    r"([\d.]+) B, on an? (\d+) GB GPU", re.MULTILINE)
TINY = "tiny-lora.toml"


@dataclass(frozen=True)
class Sizes:
    """What an example's header says: parameters (billions), block count, its GPU (GB)."""

    denoiser: float
    blocks: int | None
    encoders: float
    gpu: int


@dataclass
class Preset:
    """One preset: its TOML text and how it was made."""

    name: str
    title: str
    family: str
    gib: int | None
    example: str
    savers: list[str] = field(default_factory=list)
    estimate_gib: float | None = None
    toml: str = ""


@dataclass
class Refusal:
    """An example and GPU size without a preset, and why."""

    example: str
    gib: int
    reason: str


def examples_dir() -> Path:
    """The example run files the presets are made from, as the package ships them
    (`difftune/assets/examples`, in a source checkout a link to the top-level `examples/`), so
    an installed wheel has them too."""
    return Path(str(resources.files("difftune") / "assets" / "examples"))


def demo_dir() -> Path:
    """The demo images bundled with the package."""
    return Path(__file__).resolve().parents[2] / "assets" / "demo"


def sizes(text: str) -> Sizes | None:
    """The sizes an example's header states, or None."""
    m = _SIZES.search(text)
    if m is None:
        return None
    return Sizes(float(m[1]), int(m[2]) if m[2] else None, float(m[3]), int(m[4]))


def _gib(params_b: float, bytes_per: float) -> float:
    return params_b * 1e9 * bytes_per / GIB


class _Plan:
    """The memory arithmetic of one config (its form values) on a card of `gib` GiB."""

    def __init__(self, values: dict[str, Any], size: Sizes, gib: int) -> None:
        self.v, self.size, self.gib = dict(values), size, gib
        self.changes: dict[str, Any] = {}
        self.savers: list[str] = []

    def get(self, path: str, default: Any) -> Any:
        return self.changes.get(path, self.v.get(path, default))

    def set(self, path: str, value: Any, saver: str) -> None:
        self.changes[path] = value
        self.savers.append(saver)

    def denoiser_gib(self) -> float:
        quant = self.get("precision.quantize.denoiser", "none")
        stored = _BYTES[quant] if quant != "none" else _BYTES[self.get("precision.denoiser",
                                                                       "fp32")]
        whole = _gib(self.size.denoiser, stored)
        swap = self.get("train.blocks_to_swap", 0)
        if swap and self.size.blocks:
            block = whole / self.size.blocks
            return whole - swap * block + 2 * block
        return whole

    def training_gib(self) -> float:
        state = 2 if self.get("train.optimizer", "adamw").endswith("8bit") else 8
        lora = _gib(self.size.denoiser * LORA_SHARE, 8 + state)
        return self.denoiser_gib() + lora + RESERVE_GIB

    def encoding_gib(self) -> float:
        quant = self.get("precision.quantize.text_encoders", "none")
        te = self.get("precision.text_encoders", "fp32")
        stored = _BYTES[quant] if quant != "none" else _BYTES[te if isinstance(te, str) else "bf16"]
        return _gib(self.size.encoders, stored) + ENCODE_RESERVE_GIB


def _fit_training(plan: _Plan, family: str) -> None:
    """Add savers until training fits (or none is left)."""
    steps: list[tuple[bool, str, Any, str]] = [
        (not plan.get("train.gradient_checkpointing", False), "train.gradient_checkpointing",
         True, "gradient checkpointing"),
        (plan.get("precision.quantize.denoiser", "none") == "none" and
         _BYTES[plan.get("precision.denoiser", "fp32")] > 1, "precision.quantize.denoiser",
         "int8", "int8 denoiser"),
        (plan.get("train.optimizer", "adamw") == "adamw", "train.optimizer", "adamw8bit",
         "8-bit AdamW"),
    ]
    for usable, path, value, saver in steps:
        if plan.training_gib() <= plan.gib:
            return
        if usable:
            plan.set(path, value, saver)
    blocks = plan.size.blocks
    if plan.training_gib() <= plan.gib or not blocks or not registry.spec(family).swap_blocks:
        return
    for n in range(max(1, plan.get("train.blocks_to_swap", 0)), blocks - 1):
        plan.changes["train.blocks_to_swap"] = n
        if plan.training_gib() <= plan.gib:
            plan.savers.append(f"block swap ({n} of {blocks} blocks in host memory)")
            return


def _fit_encoding(plan: _Plan) -> None:
    """Quantize the text encoders when they do not fit alone while captions are encoded."""
    if plan.encoding_gib() > plan.gib and \
            plan.get("precision.quantize.text_encoders", "none") == "none":
        plan.set("precision.quantize.text_encoders", "int8", "int8 text encoders")
        if not plan.get("cache.unload_text_encoders", False):
            plan.set("cache.unload_text_encoders", True, "text encoders unloaded once cached")


def _example_preset(path: Path, gib: int) -> Preset | Refusal | None:
    """The preset of example `path` on `gib` GiB, a refusal, or None (no sizes in its header)."""
    text = path.read_text(encoding="utf-8")
    size = sizes(text)
    if size is None:
        return None
    doc = toml_io.parse(text, path.name)
    values = toml_io.values(doc)
    family = str(values.get("model.family", DEFAULT_FAMILY))
    full = values.get("adapter.type") == "full"
    if gib > size.gpu or (full and gib != size.gpu):
        reason = (f"a full fine-tune's trained weights need the example's {size.gpu} GB GPU"
                  if full else f"the example is made for {size.gpu} GB")
        return Refusal(path.name, gib, reason)
    plan = _Plan(values, size, gib)
    if not full:
        _fit_training(plan, family)
        _fit_encoding(plan)
    if not full and (plan.training_gib() > gib or plan.encoding_gib() > gib):
        return Refusal(path.name, gib, f"needs about {plan.training_gib():.1f} GiB to train "
                       f"even with {', '.join(plan.savers) or 'the example as it is'}")
    changes = {**plan.changes, "save.dir": "."}
    for key, value in changes.items():
        toml_io.set_value(doc, key, value)
    stem = path.name.removesuffix(".toml")
    return Preset(name=f"{stem}-{gib}gib", title=f"{_title(text, stem)} · {gib} GiB",
                  family=family, gib=gib, example=path.name, savers=plan.savers,
                  estimate_gib=None if full else round(plan.training_gib(), 1),
                  toml=toml_io.dumps(doc))


def _title(text: str, stem: str) -> str:
    """A short title from the example's second header line (`# A FLUX.1-dev LoRA on ...`)."""
    lines = [ln[2:] for ln in text.splitlines()[:3] if ln.startswith("# ")]
    words = lines[1] if len(lines) > 1 else stem
    return re.split(r" (?:on|from|in) |[:(,;]", words, maxsplit=1)[0].removeprefix("A ") \
        .removeprefix("An ").strip()


def tiny_preset(folder: Path | None = None) -> Preset | None:
    """The tiny FLUX.1 preset (CPU demo) on the bundled demo images."""
    path = (folder or examples_dir()) / TINY
    if not path.is_file():
        return None
    doc = toml_io.parse(path.read_text(encoding="utf-8"), TINY)
    demo = demo_dir()
    toml_io.set_value(doc, "datasets[0].subsets[0].path", demo.as_posix())
    toml_io.set_value(doc, "sample.prompts", (demo / "prompts.txt").as_posix())
    toml_io.set_value(doc, "save.dir", ".")
    family = str(toml_io.values(doc).get("model.family", DEFAULT_FAMILY))
    return Preset(name="tiny-flux", title="tiny FLUX.1 (CPU demo)", family=family, gib=None,
                  example=TINY, toml=toml_io.dumps(doc))


def build(folder: Path | None = None) -> tuple[list[Preset], list[Refusal]]:
    """Every preset (the tiny one first) and every example size without one (made again
    only when an example file changed)."""
    folder = folder or examples_dir()
    stamp = tuple((p.name, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.toml"))) \
        if folder.is_dir() else ()
    made, refused = _build(folder, stamp)
    return [replace(p, savers=list(p.savers)) for p in made], list(refused)


@functools.lru_cache(maxsize=4)
def _build(folder: Path, stamp: tuple[tuple[str, int], ...]) -> tuple[list[Preset],
                                                                     list[Refusal]]:
    """`build` for one state of the folder (`stamp`: its files and their times)."""
    presets: list[Preset] = []
    refused: list[Refusal] = []
    tiny = tiny_preset(folder)
    if tiny is not None:
        presets.append(tiny)
    for path in sorted(folder.glob("*.toml")) if folder.is_dir() else []:
        size = sizes(path.read_text(encoding="utf-8"))
        if size is None:
            continue
        for gib in sorted({*SIZES, size.gpu}, reverse=True):
            made = _example_preset(path, gib)
            if isinstance(made, Preset):
                presets.append(made)
            elif isinstance(made, Refusal) and gib in SIZES:
                refused.append(made)
    return presets, refused


def get(name: str, folder: Path | None = None) -> Preset:
    """The preset called `name`; KeyError when there is none."""
    for preset in build(folder)[0]:
        if preset.name == name:
            return preset
    raise KeyError(name)
