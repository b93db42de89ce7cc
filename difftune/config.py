"""The run configuration: pydantic models for every section, and `load_config`.

A run is one TOML file with the sections `model`, `precision`, `adapter`, `[[datasets]]`,
`cache`, `train`, `sample` and `save`. Everything is validated here, before anything heavy
loads: unknown keys are rejected, every problem is reported at once with its dotted field and
a fix, and cross-field conflicts are resolved or refused now rather than discovered mid-run.
Relative paths are taken relative to the config file's folder.
"""

from __future__ import annotations

import logging
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from difftune.config_errors import format_validation_error, parse_override
from difftune.errors import ConfigError, ModelFileError
from difftune.safefiles import is_pickle, pickle_refusal

log = logging.getLogger("difftune")

DType = Literal["fp32", "fp16", "bf16"]
# Default text-encoder LoRA targets: attention and MLP Linear layers of CLIP and of T5.
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2",
                        "q", "k", "v", "o", "wi_0", "wi_1", "wo")


class _Section(BaseModel):
    """Base of every section: unknown keys are an error, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which base model to fine-tune and where its files are (local files only)."""

    family: Literal["flux", "sd3", "sdxl"] = Field("flux", description="Model family.")
    flavor: Literal["tiny"] | None = Field(
        None, description='"tiny" builds the built-in tiny model that needs no files.'
    )
    path: Path | None = Field(
        None, description="A diffusers-format folder (the FLUX.1-dev / schnell layout)."
    )
    transformer: Path | None = Field(
        None, description="Single-file transformer (.safetensors, BFL or diffusers layout)."
    )
    vae: Path | None = Field(None, description="Single-file autoencoder (ae.safetensors).")
    clip_l: Path | None = Field(None, description="Single-file CLIP-L text encoder.")
    t5: Path | None = Field(None, description="Single-file T5-XXL text encoder.")
    name: str | None = Field(
        None, description="Base model name written into LoRA metadata (default: derived)."
    )
    t5_mask: bool = Field(
        False, description="Apply the attention mask in the T5 encoder (families with T5)."
    )
    clip_skip: int = Field(
        0, ge=0, le=8,
        description="Extra CLIP layers skipped from the declared hidden state (0 = as declared)."
    )

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        files = {k: getattr(self, k) for k in ("transformer", "vae", "clip_l", "t5")}
        if self.flavor == "tiny":
            given = [k for k, v in files.items() if v is not None] + (["path"] if self.path else [])
            if given:
                raise ValueError(
                    f'flavor = "tiny" needs no files, but {", ".join(given)} given; '
                    "remove them or remove flavor"
                )
            return self
        missing = [k for k, v in files.items() if v is None]
        if self.path is None and missing:
            raise ValueError(
                "no model given: set flavor = \"tiny\", or path = a diffusers folder, or all of "
                f"transformer, vae, clip_l, t5 as single files (missing: {', '.join(missing)})"
            )
        return self


StorageDType = Literal["fp32", "fp16", "bf16", "fp8"]
Quantization = Literal["none", "int8", "fp8", "qint8", "qfloat8", "nf4"]
# Which library quantizes each setting (and the pip package a user installs for it).
QUANT_BACKENDS: dict[str, tuple[str, str]] = {
    "int8": ("torchao", "torchao"), "fp8": ("torchao", "torchao"),
    "qint8": ("optimum.quanto", "optimum-quanto"), "qfloat8": ("optimum.quanto", "optimum-quanto"),
    "nf4": ("bitsandbytes", "bitsandbytes"),
}


class QuantizeConfig(_Section):
    """Weight-only quantization of the frozen base, per part (LoRA trains on top)."""

    denoiser: Quantization = Field(
        "none", description="int8/fp8 (torchao), qint8/qfloat8 (optimum-quanto), nf4 "
                            "(bitsandbytes, CUDA only), or none.")
    text_encoders: Quantization = Field("none", description="The same, for the text encoders.")


class PrecisionConfig(_Section):
    """Compute and storage dtypes."""

    mixed: Literal["no", "fp16", "bf16"] = Field(
        "no", description="Autocast dtype for the forward pass; trainable weights stay fp32."
    )
    denoiser: StorageDType = Field(
        "fp32", description="Storage dtype of the frozen denoiser (fp8: e4m3fn storage, "
                            "computed in the mixed dtype).")
    text_encoders: StorageDType | dict[str, StorageDType] = Field(
        "fp32", description="Storage dtype of the text encoders: one for all, or a table per "
                            "encoder name (e.g. {clip_l = \"bf16\", t5 = \"fp8\"}; unlisted: fp32).")

    def encoder_dtype(self, name: str) -> str:
        """The storage dtype of one text encoder."""
        te = self.text_encoders
        return te.get(name, "fp32") if isinstance(te, dict) else te

    def dtype_names(self) -> dict[str, str]:
        """Every storage setting by its dotted field name (text encoders one by one)."""
        te = self.text_encoders
        named = ({f"text_encoders.{k}": v for k, v in te.items()} if isinstance(te, dict)
                 else {"text_encoders": te})
        return {"denoiser": self.denoiser, **named, "vae": self.vae}
    vae: StorageDType = Field("fp32", description="Storage dtype of the autoencoder.")
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)


class EmbeddingConfig(_Section):
    """A new placeholder token trained as textual-inversion embeddings."""

    name: str = Field(..., pattern=r"^\S+$",
                      description="The placeholder as written in captions and prompts, e.g. <sks>.")
    tokens: int = Field(1, ge=1, le=32, description="Vectors per placeholder.")
    init: str = Field("*", min_length=1, description="Text whose token embeddings start it.")
    encoders: list[str] | None = Field(
        None, description="Text encoders that learn it (default: every one of the family).")
    kind: Literal["input", "output"] = Field(
        "input", description="input: new rows of the token-embedding table; output: vectors "
                             "that replace the encoder's output at the placeholder positions.")


class AdapterConfig(_Section):
    """The LoRA (and/or textual-inversion embeddings) to train."""

    type: Literal["lora", "embedding"] = Field(
        "lora", description="lora (optionally with embeddings: pivotal tuning) or embedding "
                            "(textual inversion alone).")
    embeddings: list[EmbeddingConfig] = Field(
        default_factory=list, description="Placeholder tokens to learn ([[adapter.embeddings]]).")
    embedding_lr: float | None = Field(
        None, gt=0, description="Learning rate of the embeddings (default: train.lr).")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank.")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (default: the rank).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    targets: Literal["attention", "attention_mlp", "all_linear"] = Field(
        "attention", description="Preset of layers that get a LoRA."
    )
    target_modules: list[str] | None = Field(
        None, description="Explicit module-name suffixes; overrides `targets` when set."
    )
    text_encoders: list[str] = Field(
        default_factory=list,
        description='Text encoders that get a LoRA too, by name (e.g. ["clip_l"]); never cached.',
    )
    text_encoder_targets: list[str] = Field(
        default_factory=lambda: list(TEXT_ENCODER_TARGETS),
        description="Module-name suffixes of the text encoders that get a LoRA.",
    )
    text_encoder_lr: float | None = Field(
        None, gt=0, description="Learning rate of the text-encoder LoRA (default: train.lr)."
    )

    @property
    def scale_alpha(self) -> float:
        """The alpha actually used (the rank when unset)."""
        return float(self.alpha if self.alpha is not None else self.rank)


class SubsetConfig(_Section):
    """One folder of images with same-stem caption files."""

    path: Path = Field(..., description="Folder of png/jpg/webp images (searched recursively).")
    repeats: int = Field(1, ge=1, description="How many times each image appears per epoch.")
    caption_ext: str = Field(".txt", description="Caption file extension.")
    default_caption: str = Field("", description="Caption for images with no caption file.")
    recursive: bool = Field(True, description="Search sub-folders too.")
    flip: bool = Field(False, description="Random horizontal flip (per sample).")
    crop: Literal["center", "random"] = Field(
        "center", description="Where to crop after resizing to the bucket."
    )
    # Caption augmentations (data/captions.py applies them, per sample, in this order).
    caption_prefix: str = Field("", description="Text put before every caption (with a space).")
    caption_suffix: str = Field("", description="Text put after every caption (with a space).")
    wildcards: bool = Field(
        False, description="Resolve `{a|b|c}` in captions to one choice per sample."
    )
    shuffle_caption: bool = Field(False, description="Shuffle the caption's tags per sample.")
    keep_tokens: int = Field(
        0, ge=0, description="Leading tags never shuffled or dropped (e.g. the trigger word)."
    )
    caption_separator: str = Field(",", min_length=1, description="What separates tags.")
    caption_tag_dropout_rate: float = Field(
        0.0, ge=0, lt=1, description="Chance that each (not kept) tag is left out, per sample."
    )
    caption_dropout_rate: float = Field(
        0.0, ge=0, le=1, description="Chance that the whole caption is empty, per sample."
    )
    token_warmup_min: int = Field(1, ge=1, description="Tags kept at step 0 of the warm-up.")
    token_warmup_steps: int = Field(
        0, ge=0, description="Steps over which the tag count grows to the full caption (0: off)."
    )

    def ignored_caption_options(self) -> list[str]:
        """Caption options set to a value that has no effect with the others (to warn about)."""
        out = []
        uses_tags = self.shuffle_caption or self.caption_tag_dropout_rate > 0
        if self.keep_tokens and not uses_tags:
            out.append("keep_tokens (needs shuffle_caption or caption_tag_dropout_rate)")
        if self.token_warmup_min != 1 and not self.token_warmup_steps:
            out.append("token_warmup_min (needs token_warmup_steps)")
        if self.caption_separator != "," and not (uses_tags or self.token_warmup_steps):
            out.append("caption_separator (needs shuffle, tag dropout or token warm-up)")
        return out


class DatasetConfig(_Section):
    """A dataset: bucketing parameters and one or more subsets.

    For a single folder, give its fields (`path`, `repeats`, ...) directly; they become one subset.
    """

    resolution: int = Field(1024, ge=64, description="Target side: buckets hold ~resolution² px.")
    min_side: int = Field(256, ge=16, description="Smallest bucket side.")
    max_side: int = Field(2048, ge=16, description="Largest bucket side.")
    bucket_step: int | None = Field(
        None, ge=8, description="Bucket side granularity (default: the family's, 16 for flux)."
    )
    buckets: bool = Field(True, description="Aspect-ratio bucketing; off = square crops.")
    subsets: list[SubsetConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and "path" in data:
            data = dict(data)
            # Only subset fields move into the subset, so an unknown key is reported where the
            # user wrote it (datasets[0].key), not inside a subset they never wrote.
            subset = {k: data.pop(k) for k in list(data) if k in SubsetConfig.model_fields}
            if data.get("subsets"):
                raise ValueError("give either `path` (one folder) or `subsets`, not both")
            data["subsets"] = [subset]
        return data

    @model_validator(mode="after")
    def _sides(self) -> "DatasetConfig":
        if not self.subsets:
            raise ValueError("no images: set `path` or add [[datasets.subsets]] with a path")
        if self.min_side > self.max_side:
            raise ValueError(f"min_side ({self.min_side}) is larger than max_side ({self.max_side})")
        if not self.min_side <= self.resolution <= self.max_side:
            raise ValueError(
                f"resolution ({self.resolution}) must lie between min_side ({self.min_side}) "
                f"and max_side ({self.max_side})"
            )
        return self


class CacheConfig(_Section):
    """What is computed once before training instead of every step."""

    latents: Literal["memory", "disk", "none"] = Field(
        "memory", description="Cache VAE latents: in memory, on disk (kept across runs), or not."
    )
    text: Literal["memory", "disk", "none"] = Field(
        "memory", description="Cache text-encoder outputs: in memory, on disk, or not."
    )
    dir: Path | None = Field(
        None, description="Folder of the disk caches (default: <save.dir>/cache); shareable."
    )
    caption_variants: int = Field(
        0, ge=0, le=1024,
        description="Random caption augmentations: K variants per caption pre-encoded from the "
                    "seed (encoders can then be offloaded); 0: a fresh draw per sample, encoded "
                    "on demand with the cache as a memo (encoders stay resident).",
    )
    offload: bool = Field(
        True, description="Move the VAE and frozen text encoders off the accelerator once cached."
    )
    unload_text_encoders: bool = Field(
        False, description="Free the frozen text encoders once their outputs are cached; new "
                           "text (an edited prompt file) reloads them from their files."
    )


class TrainConfig(_Section):
    """The optimisation recipe."""

    steps: int = Field(1000, ge=1, description="Optimizer steps to run.")
    batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    optimizer: Literal["adamw"] = "adamw"
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip gradients (unset: off).")
    gradient_checkpointing: bool = False
    seed: int = 42
    timesteps: Literal["uniform", "sigmoid", "shift", "flux_shift"] = Field(
        "sigmoid", description="How training timesteps are drawn."
    )
    sigmoid_mean: float = Field(0.0, description="Logit-normal mean (sigmoid, shift).")
    sigmoid_std: float = Field(1.0, gt=0, description="Logit-normal std (sigmoid, shift).")
    shift: float = Field(3.0, gt=0, description="Fixed shift for timesteps = \"shift\".")
    guidance: float = Field(1.0, ge=0, description="Guidance input for guidance-distilled models.")
    prediction: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto", description="DDPM families: the target (auto: the model's scheduler config)."
    )
    zero_terminal_snr: bool = Field(
        False, description="DDPM families: rescale the schedule to zero SNR at the last step."
    )
    noise_offset: float = Field(0.0, ge=0, description="DDPM families: noise offset strength.")
    min_snr_gamma: float | None = Field(
        None, gt=0, description="DDPM families: Min-SNR-gamma loss weighting (e.g. 5)."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")
    max_nonfinite_steps: int = Field(
        10, ge=1, description="Non-finite losses in a row that stop the run (each is skipped)."
    )

    @model_validator(mode="after")
    def _ddpm(self) -> "TrainConfig":
        if self.zero_terminal_snr and self.prediction == "epsilon":
            raise ValueError(
                "zero_terminal_snr needs prediction = \"v_prediction\" (an epsilon target is "
                "undefined at zero SNR); set train.prediction = \"v_prediction\""
            )
        return self

    @model_validator(mode="after")
    def _warmup(self) -> "TrainConfig":
        if self.warmup_steps >= self.steps and self.warmup_steps > 0:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than steps ({self.steps})"
            )
        return self


class SampleConfig(_Section):
    """Sample images during training, from a prompt file."""

    prompts: Path | None = Field(None, description="Prompt file (one prompt a line).")
    every_n_steps: int | None = Field(
        None, ge=1, description="Also save the LoRA and a resume checkpoint every N steps.")
    keep_last: int | None = Field(
        None, ge=1, description="Keep only the K newest checkpoints (default: all).")
    at_start: bool = Field(False, description="Sample before the first step (a baseline).")
    at_end: bool = Field(True, description="Sample after the last step (needs prompts).")
    width: int | None = Field(None, ge=16, description="Default width (default: resolution).")
    height: int | None = Field(None, ge=16, description="Default height (default: resolution).")
    steps: int = Field(20, ge=1, description="Default denoising steps.")
    guidance: float = Field(3.5, ge=0, description="Default distilled guidance.")
    cfg: float | None = Field(
        None, ge=1.0, description="Default CFG scale (1 = off; default: the family's)."
    )
    seed: int = Field(0, description="Default seed.")

    @model_validator(mode="after")
    def _needs_prompts(self) -> "SampleConfig":
        if self.prompts is None and (self.every_n_steps or self.at_start):
            raise ValueError("sampling is scheduled but `prompts` is not set; set sample.prompts")
        return self


class SaveConfig(_Section):
    """Where and how the LoRA is written."""

    dir: Path = Field(..., description="Output folder.")
    name: str = Field("lora", pattern=r"^[A-Za-z0-9_.-]+$", description="File name stem.")
    every_n_steps: int | None = Field(
        None, ge=1, description="Also save the LoRA and a resume checkpoint every N steps.")
    keep_last: int | None = Field(
        None, ge=1, description="Keep only the K newest checkpoints (default: all).")
    format: Literal["diffusers", "kohya"] = Field(
        "diffusers", description="diffusers/PEFT keys, or kohya/ComfyUI keys."
    )
    dtype: DType = Field("bf16", description="dtype of the saved LoRA tensors.")
    overwrite: bool = Field(False, description="Allow writing into a folder holding a LoRA.")


class RunConfig(_Section):
    """The whole run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    datasets: list[DatasetConfig] = Field(..., min_length=1)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sample: SampleConfig = Field(default_factory=SampleConfig)
    save: SaveConfig

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        problems = []
        p = self.precision
        low = [f"precision.{k} = \"{v}\"" for k, v in p.dtype_names().items() if v != "fp32"]
        if p.mixed == "no" and low:
            problems.append(
                f"{', '.join(low)} needs precision.mixed = \"bf16\" or \"fp16\" (fp32 compute "
                "on low-precision weights fails); set precision.mixed or keep those at fp32"
            )
        problems += quantize_problems(p, self.train.device)
        problems += objective_problems(self.model.family, self.train)
        problems += text_encoder_problems(self.model, self.adapter, self.save.format, p)
        problems += unload_problems(self)
        problems += embedding_problems(self)
        every = self.save.every_n_steps
        if every is not None and every > self.train.steps:
            problems.append(
                f"save.every_n_steps ({every}) is larger than train.steps ({self.train.steps}); "
                "lower it or leave it unset (the end of the run is always saved)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


# The text encoders each family declares (kept in sync with the family classes by a unit test),
# and the families whose CLIP hidden states reach the denoiser (where clip_skip means something).
TEXT_ENCODERS: dict[str, tuple[str, ...]] = {
    "flux": ("clip_l", "t5"), "sd3": ("clip_l", "clip_g", "t5"), "sdxl": ("clip_l", "clip_g")}
CLIP_HIDDEN: dict[str, bool] = {"flux": False, "sd3": True, "sdxl": True}
# Why a kohya-format file cannot hold a text-encoder LoRA for a family (absent: it can).
KOHYA_TEXT_ENCODERS_REFUSED: dict[str, str] = {
    "flux": "difftune's FLUX.1 kohya key table covers the transformer only",
    "sd3": "there is no kohya key layout for SD3 text encoders that diffusers reads back",
}


def text_encoder_problems(model: ModelConfig, adapter: AdapterConfig, fmt: str,
                          precision: PrecisionConfig | None = None) -> list[str]:
    """Text-encoder options the family cannot honour (unknown names, masks, skips, formats)."""
    family = model.family
    names = TEXT_ENCODERS.get(family, ())
    problems = [f"adapter.text_encoders: {n!r} is not a text encoder of model.family = "
                f"\"{family}\"; choose from {', '.join(names)}"
                for n in adapter.text_encoders if n not in names]
    if precision is not None and isinstance(precision.text_encoders, dict):
        problems += [f"precision.text_encoders: {n!r} is not a text encoder of model.family = "
                     f"\"{family}\"; choose from {', '.join(names)}"
                     for n in precision.text_encoders if n not in names]
    if len(set(adapter.text_encoders)) != len(adapter.text_encoders):
        problems.append("adapter.text_encoders lists an encoder twice; list each once")
    if model.t5_mask and "t5" not in names:
        problems.append(f"model.t5_mask: model.family = \"{family}\" has no T5 encoder; remove it")
    if model.clip_skip and not CLIP_HIDDEN.get(family, False):
        problems.append(f"model.clip_skip: model.family = \"{family}\" reads no CLIP hidden "
                        "state (only CLIP's pooled output), so there is nothing to skip; remove it")
    if fmt == "kohya" and adapter.text_encoders and family in KOHYA_TEXT_ENCODERS_REFUSED:
        problems.append(f"save.format = \"kohya\" cannot hold the text-encoder LoRA of "
                        f"model.family = \"{family}\" ({KOHYA_TEXT_ENCODERS_REFUSED[family]}); "
                        "use save.format = \"diffusers\" or train the denoiser only")
    return problems


def quantize_problems(p: PrecisionConfig, device: str) -> list[str]:
    """Quantization settings that cannot work here: conflicts, missing libraries, no CUDA."""
    import importlib.util

    import torch

    problems = []
    for part in ("denoiser", "text_encoders"):
        q = getattr(p.quantize, part)
        if q == "none":
            continue
        if any(v == "fp8" for k, v in p.dtype_names().items() if k.startswith(part)):
            problems.append(f"precision.quantize.{part} = \"{q}\" and precision.{part} = "
                            "\"fp8\" both shrink the same weights; choose one")
        module, package = QUANT_BACKENDS[q]
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None):
            problems.append(f"precision.quantize.{part} = \"{q}\" needs the {package} "
                            f"package; install it (pip install {package}) or choose another")
        if q == "nf4" and (device == "cpu" or not torch.cuda.is_available()):
            problems.append(f"precision.quantize.{part} = \"nf4\" needs a CUDA device "
                            "(bitsandbytes' 4-bit kernels); on this machine use \"int8\" or "
                            "\"qint8\"")
    return problems


def embedding_problems(cfg: "RunConfig") -> list[str]:
    """Textual-inversion settings that cannot work (checked at load, not mid-run)."""
    a, names = cfg.adapter, TEXT_ENCODERS.get(cfg.model.family, ())
    problems = []
    if a.type == "embedding" and not a.embeddings:
        problems.append("adapter.type = \"embedding\" needs at least one [[adapter.embeddings]] "
                        "table (name, tokens, init)")
    if a.type == "embedding" and a.text_encoders:
        problems.append("adapter.text_encoders trains text-encoder LoRAs, but adapter.type = "
                        "\"embedding\" trains no LoRA; use adapter.type = \"lora\" for both")
    seen = [e.name for e in a.embeddings]
    if len(set(seen)) != len(seen):
        problems.append("adapter.embeddings: a placeholder name is used twice; give each its own")
    for i, e in enumerate(a.embeddings):
        bad = [n for n in e.encoders or () if n not in names]
        if bad:
            problems.append(f"adapter.embeddings[{i}].encoders: {bad} not text encoders of "
                            f"model.family = \"{cfg.model.family}\"; choose from {', '.join(names)}")
    if a.embeddings and cfg.cache.unload_text_encoders:
        problems.append("cache.unload_text_encoders with adapter.embeddings: captions with a "
                        "placeholder are encoded live every step, so the encoders must stay")
    return problems


def unload_problems(cfg: "RunConfig") -> list[str]:
    """`cache.unload_text_encoders` needs every text the training steps use to be cached."""
    if not cfg.cache.unload_text_encoders:
        return []
    if cfg.cache.text == "none":
        return ["cache.unload_text_encoders needs cached text (cache.text = \"memory\" or "
                "\"disk\"): without a cache the encoders run every step"]
    live = [f"datasets[{d}].subsets[{i}]" for d, ds in enumerate(cfg.datasets)
            for i, sub in enumerate(ds.subsets)
            if sub.shuffle_caption or sub.caption_tag_dropout_rate > 0 or sub.wildcards]
    if live and not cfg.cache.caption_variants:
        return [f"cache.unload_text_encoders with random caption augmentations ({', '.join(live)})"
                " would reload the encoders every step; set cache.caption_variants = K to "
                "pre-encode K variants per caption"]
    return []


# What each family is trained with; options of one objective are refused for the other.
OBJECTIVES: dict[str, str] = {"flux": "flow", "sd3": "flow", "sdxl": "ddpm"}
_DDPM_ONLY = {"prediction": "auto", "zero_terminal_snr": False, "noise_offset": 0.0,
              "min_snr_gamma": None}
_FLOW_ONLY = {"timesteps": "sigmoid", "sigmoid_mean": 0.0, "sigmoid_std": 1.0, "shift": 3.0}


def objective_problems(family: str, train: TrainConfig) -> list[str]:
    """Options set for the objective this family does not train with (never silently ignored)."""
    kind = OBJECTIVES.get(family)
    ignored = _DDPM_ONLY if kind == "flow" else _FLOW_ONLY if kind == "ddpm" else {}
    set_here = [k for k, default in ignored.items()
                if k in train.model_fields_set and getattr(train, k) != default]
    return [f"train.{k} does not apply to model.family = \"{family}\" (trained with "
            f"{'flow matching' if kind == 'flow' else 'DDPM'}); remove it" for k in set_here]


def _resolve_paths(node: Any, base: Path) -> None:
    """Make every Path field of `node` (recursively) absolute, relative to `base`."""
    if isinstance(node, list):
        for item in node:
            _resolve_paths(item, base)
        return
    if not isinstance(node, BaseModel):
        return
    for name in type(node).model_fields:
        value = getattr(node, name)
        if isinstance(value, Path) and not value.is_absolute():
            object.__setattr__(node, name, (base / value.expanduser()).resolve())
        elif isinstance(value, Path):
            object.__setattr__(node, name, value.expanduser())
        else:
            _resolve_paths(value, base)


def model_file_problems(model: ModelConfig) -> list[str]:
    """Cheap checks of the model paths (exist, right kind, not pickle), all reported at once."""
    problems = []
    if model.path is not None and not model.path.is_dir():
        problems.append(f"model.path: {model.path} is not a folder; expected a diffusers-format "
                        "model folder (with model_index.json)")
    for name in ("transformer", "vae", "clip_l", "t5"):
        path = getattr(model, name)
        if path is None:
            continue
        if is_pickle(path):
            problems.append(f"model.{name}: {pickle_refusal(path)}")
        elif not path.is_file():
            problems.append(f"model.{name}: {path} does not exist; expected a .safetensors file")
        elif path.suffix.lower() != ".safetensors":
            problems.append(f"model.{name}: {path} is not a .safetensors file")
    return problems


def parse_config(data: dict[str, Any], base: Path, source: str = "config") -> RunConfig:
    """Validate a config mapping; relative paths are resolved against `base`.

    Also checks the model paths (cheap: existence and kind), so a wrong file is reported in
    seconds rather than after the data has been scanned.
    """
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None
    _resolve_paths(cfg, base)
    if cfg.cache.dir is None:
        cfg.cache.dir = cfg.save.dir / "cache"
    warn_ignored(cfg)
    problems = model_file_problems(cfg.model)
    if problems:
        raise ModelFileError(f"{source}: model files:\n  - " + "\n  - ".join(problems))
    return cfg


def warn_ignored(cfg: RunConfig) -> None:
    """One warning for each option that is set but has no effect with the rest of the config."""
    for d, ds in enumerate(cfg.datasets):
        for i, sub in enumerate(ds.subsets):
            for what in sub.ignored_caption_options():
                log.warning("datasets[%d].subsets[%d].%s is ignored", d, i, what)
    randomized = any(sub.shuffle_caption or sub.caption_tag_dropout_rate > 0 or sub.wildcards
                     for ds in cfg.datasets for sub in ds.subsets)
    if cfg.cache.caption_variants and not randomized:
        log.warning("cache.caption_variants is ignored: no subset has a random caption "
                    "augmentation (shuffle_caption, caption_tag_dropout_rate, wildcards)")


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML run file, apply `a.b=value` overrides, and validate everything at once."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a .toml run file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}; fix the syntax at that place") from None
    for item in overrides or []:
        parse_override(data, item)
    return parse_config(data, path.resolve().parent, str(path))
