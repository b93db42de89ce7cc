"""How much GPU memory a run takes, estimated from parameter counts: the one answer `difftune
check`, the web app's presets, the README's table and the examples' headers all quote.

It is arithmetic, not a measurement (nothing here imports torch), and says so wherever it is
shown. The run loads every part onto the GPU in its load dtype (train/setup.py: the denoiser
goes to the host instead when blocks are swapped), then quantizes or stores in fp8 what the
config asks, caches, moves the VAE and text encoders off (`cache.offload`) and trains, so the
peak is the largest of three phases:

- loading: the denoiser (unless it loads on the host) and the text encoders in their load
  dtype (bf16 before an int8 quantization; the mixed dtype before fp8 storage);
- caching: the denoiser's resident weights, the text encoders and VAE, and the encoders' own
  activations (`ENCODE_GIB`);
- training: the resident weights, what is trained (fp32 weight and gradient, the gradient
  left out with `train.fused_backward`, an EMA on the GPU, plus the optimizer's state as
  `train.optimizer.specs.state_bytes` counts it), the activations, and the text encoders too
  when their outputs are not cached or not offloaded.

Resident weights: parameters times the bytes of their storage (4 fp32, 2 bf16/fp16, 1 fp8 or
int8, 0.5 nf4); with block swap, the swapped blocks leave the GPU and two are in flight (blocks
taken as equal in size). Activations follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models"): a transformer layer keeps about 34 bytes per token
and hidden unit in 16-bit compute (with fused attention, whose score matrix is not kept), twice
that in fp32; with gradient checkpointing only each layer's 16-bit input is kept, plus one
layer's full activations while it is recomputed. Tokens are the image's (one per `patch` x
`patch` pixels) plus the longest text the denoiser reads. `CONTEXT_GIB` covers the CUDA context
and the allocator's slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from difftune.families import registry
from difftune.families.specs import FamilySpec, ModelSize
from difftune.train.optimizers.specs import parse_args, state_bytes

GIB = 2 ** 30
CONTEXT_GIB = 1.0  # CUDA context and allocator slack
ENCODE_GIB = 1.0  # a text encoder's activations while captions are encoded
LORA_SHARE = 0.005  # LoRA parameters per denoiser parameter at rank 16 (Qwen-Image's
                    # attention_mlp: 106 M of 20.43 B), scaled by rank
CARDS = (24, 16, 12)  # the GPU sizes presets, `check` and the README speak of
BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "qint8": 1.0,
         "qfloat8": 1.0, "nf4": 0.5}
LABEL = "an estimate from parameter counts, not measured on a GPU"
# Not a config field: the frames of the longest clip a run trains (`check` sets it from its
# dataset; a run of images leaves it out), read by `Setup.from_values` like the fields.
CLIP_FRAMES = "clip_frames"


@dataclass(frozen=True)
class Setup:
    """The settings of a run that decide its memory (read from form values or a config)."""

    denoiser: str = "fp32"  # storage dtype, or the quantization when there is one
    encoders: str = "fp32"
    denoiser_load: str = "fp32"  # the dtype it reaches the GPU in, before quantization
    encoders_load: str = "fp32"
    mixed: str = "no"
    optimizer: str = "adamw"
    checkpointing: bool = False
    swap: int = 0
    batch: int = 1
    resolution: int = 1024
    rank: int = 16
    trained: float | None = None  # trained parameters (B) when counted, else the LoRA share
    references: int = 0  # reference images an edit pair adds to the denoiser's tokens
    text_resident: bool = False  # text encoders stay on the GPU while training
    full: bool = False  # a full fine-tune: the trained weights are the denoiser's own
    fused: bool = False  # train.fused_backward: no gradient kept
    ema: bool = False  # an EMA of the trained weights on the GPU
    frames: int = 1  # the longest clip's frames (1: images only)

    @classmethod
    def from_values(cls, v: Mapping[str, Any], trained: float | None = None) -> "Setup":
        """The settings a run file sets, by form path (`precision.denoiser`, ...); `trained`:
        the trained parameters (B) where they were counted."""
        te = v.get("precision.text_encoders", "fp32")
        te = max(te.values(), key=BYTES.__getitem__) if isinstance(te, dict) else te
        dn, mixed = v.get("precision.denoiser", "fp32"), v.get("precision.mixed", "no")
        sides = [s for k, r in v.items() if k.startswith("datasets[") and
                 k.endswith(".resolution")
                 for s in (r if isinstance(r, list) else [r])]
        return cls(
            denoiser=_stored(v.get("precision.quantize.denoiser", "none"), dn),
            encoders=_stored(v.get("precision.quantize.text_encoders", "none"), te),
            denoiser_load=_loaded(dn, mixed), encoders_load=_loaded(te, mixed),
            mixed=mixed, optimizer=v.get("train.optimizer", "adamw"),
            checkpointing=bool(v.get("train.gradient_checkpointing", False)),
            swap=int(v.get("train.blocks_to_swap", 0)), batch=int(v.get("train.batch_size", 1)),
            resolution=max(sides, default=1024), rank=int(v.get("adapter.rank", 16)),
            trained=trained, references=sum(1 for k, x in v.items()
                                            if k.endswith("control_path") and x),
            text_resident=v.get("cache.text", "memory") == "none" or
            not v.get("cache.offload", True),
            full=v.get("adapter.type") == "full", fused=bool(v.get("train.fused_backward")),
            ema=bool(v.get("train.ema.enabled")) and not v.get("train.ema.cpu", False),
            frames=int(v.get(CLIP_FRAMES, _longest(v))))


def _longest(v: Mapping[str, Any]) -> int:
    """The most frames a run file's datasets list (`datasets[i].frames`; 1 where none does):
    an example's clip length. `check` sets `CLIP_FRAMES` from the clips it found instead."""
    return max((max(x) for k, x in v.items() if k.startswith("datasets[")
                and k.endswith(".frames") and isinstance(x, list) and x), default=1)


def _stored(quant: str, dtype: str) -> str:
    """The bytes-deciding storage: the quantization where one is set, else the dtype."""
    return quant if quant != "none" else dtype


def _loaded(dtype: str, mixed: str) -> str:
    """The dtype a part is loaded in: fp8 storage loads in the mixed dtype (PrecisionPolicy)."""
    return ("fp32" if mixed == "no" else mixed) if dtype == "fp8" else dtype


@dataclass(frozen=True)
class Estimate:
    """GiB per part, and the peak of the three phases."""

    weights: float
    trained: float
    activations: float
    encoders: float
    loading: float
    caching: float
    training: float

    @property
    def phases(self) -> tuple[float, float, float]:
        """Loading, caching, training."""
        return self.loading, self.caching, self.training

    @property
    def peak(self) -> float:
        """The largest phase: what the GPU must hold."""
        return max(self.phases)

    @property
    def phase(self) -> str:
        """The phase that holds the peak, in words."""
        return ("loading (before quantization)", "caching captions",
                "training")[self.phases.index(self.peak)]

    def describe(self, s: Setup) -> str:
        """`estimated peak: 14.2 GiB on the GPU (...)` with the parts, labelled an estimate."""
        clip = f", {s.frames} frames" if s.frames > 1 else ""
        return (f"estimated peak: {self.peak:.1f} GiB on the GPU, while {self.phase} (denoiser "
                f"weights {self.weights:.1f}, trained weights with gradients and optimizer state "
                f"{self.trained:.1f}, activations {self.activations:.1f} at {s.resolution}x"
                f"{s.resolution}{clip} batch {s.batch}, text encoders {self.encoders:.1f} GiB; "
                f"{LABEL})")


def _gib(billions: float, per: float) -> float:
    return billions * 1e9 * per / GIB


def _state_per_parameter(optimizer: str) -> float:
    """The optimizer's state bytes per fp32 parameter, as its library keeps it."""
    return state_bytes(optimizer, parse_args(optimizer, {}), [(1024, 1024)], 4) / 1024 ** 2


def latent_frames(spec: FamilySpec, frames: int) -> int:
    """The latent frames of a clip: the first frame, then one per `step` frames of the
    family's frame rule (Wan: 4N+1 frames -> N+1); 1 for images or an image family."""
    if spec.frame_rule is None or frames <= 1:
        return 1
    step, offset = spec.frame_rule
    return (frames - offset) // step + 1


def tokens(size: ModelSize, spec: FamilySpec, s: Setup) -> int:
    """The tokens one sample puts through each layer: its image's (each latent frame's, for
    a clip), as many again per reference image of an edit pair (taken at the same size), and
    its longest text."""
    text = max((te.max_length for te in spec.text_encoders if te.hidden != "none"), default=0)
    refs = min(s.references, spec.control_images)
    return (s.resolution // size.patch) ** 2 * (1 + refs) * latent_frames(spec, s.frames) + text


def estimate(size: ModelSize, spec: FamilySpec, s: Setup) -> Estimate:
    """The memory of setup `s` on the model of `size` (see the module docstring)."""
    whole = _gib(size.denoiser, BYTES[s.denoiser])
    block = whole / size.layers
    swapped = min(s.swap, size.layers - 2) if spec.swap_blocks else 0
    weights = whole - swapped * block + (2 * block if swapped else 0)
    trained_b = s.trained if s.trained is not None else size.denoiser * LORA_SHARE * s.rank / 16
    if s.full:  # those weights are held as trained (fp32) rather than in the base's storage
        weights -= _gib(trained_b, BYTES[s.denoiser])
    per_trained = 4 + (0 if s.fused else 4) + (4 if s.ema else 0)  # weight, gradient, EMA
    trained = _gib(trained_b, per_trained + _state_per_parameter(s.optimizer))
    per = 34 * (2 if s.mixed == "no" else 1)  # bytes per token and hidden unit, one layer
    layer = tokens(size, spec, s) * size.width * s.batch / GIB
    activations = layer * (2 * size.layers + per) if s.checkpointing else layer * per * \
        size.layers
    encoders = _gib(size.encoders, BYTES[s.encoders])
    # Swapped blocks, and a two-expert model's experts, load in host memory (an expert
    # moves in, quantized, when it runs).
    on_host = swapped or spec.experts
    loading = (0 if on_host else _gib(size.denoiser, BYTES[s.denoiser_load])) + \
        _gib(size.encoders, BYTES[s.encoders_load]) + CONTEXT_GIB
    caching = weights + encoders + ENCODE_GIB + CONTEXT_GIB
    training = weights + trained + activations + CONTEXT_GIB + (encoders if s.text_resident
                                                                else 0)
    return Estimate(weights, trained, activations, encoders, loading, caching, training)


@dataclass
class Fit:
    """A config's changes (form path -> value) to fit a card, the savers they are, and the
    estimate with them; `fits` is False when even every saver leaves it too large."""

    changes: dict[str, Any]
    savers: list[str]
    estimate: Estimate
    fits: bool


# The savers in the order they are tried (form path, value, name): cheapest in speed and
# quality first; block swap (slowest) comes last, where the family can swap blocks.
SAVERS: tuple[tuple[str, Any, str], ...] = (
    ("train.gradient_checkpointing", True, "gradient checkpointing"),
    ("precision.quantize.denoiser", "int8", "int8 denoiser"),
    ("precision.quantize.text_encoders", "int8", "int8 text encoders"),
    ("train.optimizer", "adamw8bit", "8-bit AdamW"))
SAVER_PATHS = frozenset([p for p, _, _ in SAVERS] + ["train.blocks_to_swap"])


def fit(values: Mapping[str, Any], size: ModelSize, spec: FamilySpec, gib: float,
        trained: float | None = None) -> Fit:
    """Add savers, in order, while the estimate exceeds `gib` (each only where it lowers a
    phase that exceeds it), then swap the fewest blocks that fit where the family can swap
    blocks (which also loads the denoiser on the host, where it is quantized)."""
    v = dict(values)
    changes: dict[str, Any] = {}
    savers: list[str] = []

    def phases(extra: Mapping[str, Any]) -> tuple[float, ...]:
        return estimate(size, spec, Setup.from_values({**v, **changes, **extra},
                                                      trained)).phases

    def peak(extra: Mapping[str, Any]) -> float:
        return max(phases(extra))

    for path, value, name in SAVERS:
        now, then = phases({}), phases({path: value})
        if max(now) > gib and any(b < a and a > gib for a, b in zip(now, then)) and \
                (path != "train.optimizer" or v.get(path, "adamw") == "adamw"):
            changes[path] = value
            savers.append(name)
    if peak({}) > gib and spec.swap_blocks:
        start = max(1, int(v.get("train.blocks_to_swap", 0)))
        tried = range(start, size.layers - 1)
        # the fewest blocks that fit, else (refused) the count that comes closest
        n = next((n for n in tried if peak({"train.blocks_to_swap": n}) <= gib),
                 min(tried, key=lambda n: peak({"train.blocks_to_swap": n}), default=0))
        if n:
            changes["train.blocks_to_swap"] = n
            savers.append(f"block swap ({n} of {size.layers} blocks in host memory)")
    final = estimate(size, spec, Setup.from_values({**v, **changes}, trained))
    return Fit(changes, savers, final, final.peak <= gib)


def advice(size: ModelSize, spec: FamilySpec, values: Mapping[str, Any],
           trained: float | None = None) -> str:
    """`fits 24 GiB as it is; 16 GiB with int8 denoiser; 12 GiB with ...`: what this config
    needs on each common card (the same savers the presets add)."""
    parts = []
    for gib in CARDS:
        f = fit(values, size, spec, gib, trained)
        if not f.fits:
            parts.append(f"not {gib} GiB even with every saver ({f.estimate.peak:.1f} GiB)")
        else:
            parts.append(f"{gib} GiB " + (f"with {', '.join(f.savers)}" if f.savers
                                          else "as it is"))
    return "fits " + "; ".join(parts)


def counted(spec: FamilySpec, denoiser: float, encoders: float, layers: int | None) -> ModelSize:
    """The size of a loaded model: the family's released size whose denoiser count it has
    (within 1%), else one made from the counts (a layer's width taken from its parameters,
    about 12 x width² in a transformer layer)."""
    for size in spec.sizes:
        if abs(size.denoiser - denoiser) <= 0.01 * size.denoiser:
            return size
    like = spec.sizes[0] if spec.sizes else ModelSize("", denoiser, encoders, 1, 1)
    n = layers or like.layers
    width = max(1, round(math.sqrt(denoiser * 1e9 / n / 12)))
    return replace(like, name="the loaded model", denoiser=denoiser, encoders=encoders,
                   layers=n, width=width)


def flatten(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config as form paths (`precision.denoiser`, `datasets[0].resolution`): how `check`
    hands a loaded config to the same functions the presets use."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            out |= flatten(value, path)
        elif isinstance(value, list) and value and all(isinstance(x, Mapping) for x in value):
            for i, item in enumerate(value):
                out |= flatten(item, f"{path}[{i}]")
        else:
            out[path] = value
    return out


def released(family: str, name: str) -> tuple[FamilySpec, ModelSize]:
    """The released size called `name` of `family`, with the spec of the variant it is of;
    KeyError naming the choices."""
    found = [(spec, size) for _, spec in registry.variant_specs(family) for size in spec.sizes]
    for spec, size in found:
        if size.name == name:
            return spec, size
    raise KeyError(f"{name!r} is not a released model of {family}; sized are: "
                   f"{', '.join(size.name for _, size in found)}")
