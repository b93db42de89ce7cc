"""The sections of a run configuration: one pydantic model per TOML table.

A run is one TOML file with the sections `model`, `precision`, `adapter`, `[[datasets]]`,
`cache`, `train`, `sample` and `save`. Everything is validated here, before anything heavy
loads: unknown keys are rejected, every problem is reported at once with its dotted field and
a fix, and cross-field conflicts are resolved or refused now rather than discovered mid-run.
Relative paths are taken relative to the config file's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from difftune.config import model_source
from difftune.config.base import Beta, ClipNorm
from difftune.config.base import Section as _Section
from difftune.config.keep_best import Measure
from difftune.train.optimizers import specs as optimizers

DType = Literal["fp32", "fp16", "bf16"]


class ModelConfig(_Section):
    """Which base model to fine-tune and where its files are (local files only)."""

    family: str = Field("flux", description="Model family (one of `families.registry.names()`).")
    variant: str | None = Field(
        None, description="The released kind, for families with several (their spec's "
                          "variants); default: what model.path's model_index.json declares, "
                          "else the family's first. model.flavor = \"tiny\" builds its tiny "
                          "flavor.")
    flavor: Literal["tiny"] | None = Field(
        None, description='"tiny" builds the built-in tiny model that needs no files.'
    )
    path: Path | None = Field(None, description=model_source.path_help())
    transformer: Path | None = Field(
        None, description=model_source.single_help("transformer", "denoiser or checkpoint"))
    transformer_2: Path | None = Field(
        None, description=model_source.single_help("transformer_2", "second expert"))
    vae: Path | None = Field(None, description=model_source.single_help("vae", "autoencoder"))
    clip_l: Path | None = Field(
        None, description=model_source.single_help("clip_l", "CLIP-L text encoder"))
    t5: Path | None = Field(None, description=model_source.single_help("t5", "T5-XXL text encoder"))
    text_encoder: Path | None = Field(
        None, description=model_source.single_help("text_encoder", "decoder-LLM text encoder")
        + " Its tokenizer comes from model.path.")
    image_encoder: Path | None = Field(
        None, description=model_source.single_help("image_encoder", "CLIP vision encoder")
        + " Its image processor comes from model.path.")
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

    @field_validator("family")
    @classmethod
    def _registered(cls, family: str) -> str:
        """A family the registry knows (reported as a choice among its names)."""
        from difftune.families.registry import names

        choices = names()
        if family not in choices:
            expected = " or ".join([", ".join(repr(n) for n in choices[:-1]), repr(choices[-1])])
            raise PydanticCustomError("literal_error", "Input should be {expected}",
                                      {"expected": expected})
        return family

    @model_validator(mode="after")
    def _variant(self) -> "ModelConfig":
        """The variant resolved once, here: as given, from the folder, or the default (see
        `families.registry.resolve_variant`)."""
        from difftune.families.registry import resolve_variant

        # Written past validate_assignment, which would run this validator again.
        self.__dict__["variant"] = resolve_variant(self.family, self.variant, self.path)
        return self

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        """One source: the tiny flavor alone, or the family's folder and/or single files
        (what each family needs is its spec's `files`: see config/model_source.py)."""
        if self.flavor == "tiny":
            given = [k for k in model_source.SINGLE_KEYS if getattr(self, k) is not None]
            given += ["path"] if self.path else []
            if given:
                raise ValueError(
                    f'flavor = "tiny" needs no files, but {", ".join(given)} given; '
                    "remove them or remove flavor"
                )
            return self
        problems = model_source.source_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


StorageDType = Literal["fp32", "fp16", "bf16", "fp8"]
Quantization = Literal["none", "int8", "fp8", "qint8", "qfloat8", "nf4"]



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


class EmaConfig(_Section):
    """An exponential moving average of the trained weights (diffusers' EMAModel)."""

    enabled: bool = Field(False, description="Keep an EMA of the trained weights.")
    decay: float = Field(0.999, gt=0, lt=1, description="The EMA decay (the weight of the "
                         "average at each update; reached after the warm-up ramp).")
    every_n_steps: int = Field(1, ge=1, description="Update the EMA every N optimizer steps.")
    warmup: bool = Field(True, description="diffusers' ramp: the first update takes the weights, "
                         "the k-th after it uses min(decay, k / (9 + k)); false: decay from "
                         "the second update on.")
    cpu: bool = Field(False, description="Keep the EMA in host memory (no accelerator memory; "
                      "each update copies the weights to the host tensor by tensor).")
    use_for: list[Literal["saves", "samples"]] = Field(
        default_factory=lambda: ["saves"],
        description="What uses the EMA weights: the saved files (LoRA / fine-tuned model) "
                    "and/or the samples; checkpoints always hold both.")


class TrainConfig(_Section):
    """The optimisation recipe."""

    steps: int = Field(1000, ge=1, description="Optimizer steps to run.")
    batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    optimizer: optimizers.OptimizerName = Field(
        "adamw", description="adamw (torch), adamw8bit and lion8bit (bitsandbytes, CUDA only: "
        "8-bit state), prodigy (prodigyopt: finds its own step size, lr = 1.0), adafactor "
        "(transformers: factored state), schedulefree_adamw (schedulefree: no decay "
        "schedule), came (came-pytorch), lion (lion-pytorch). See the README's Optimizers.")
    optimizer_args: dict[str, Any] = Field(
        default_factory=dict, description="The chosen optimizer's own options (e.g. "
        "{ d_coef = 0.8 } for prodigy, { relative_step = true } for adafactor); each key is "
        "checked against the options that optimizer takes.")
    weight_decay: float = Field(0.01, ge=0, description="Weight decay, for the optimizers "
                                "that take it (unset: 0.01 for AdamW, each other's default).")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Adam-style betas, each in "
                                     "[0, 1) (unset: Lion's own (0.9, 0.99) for lion).")
    eps: float = Field(1e-8, gt=0, description="Adam-style epsilon, for the optimizers that "
                       "take it.")
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: ClipNorm = Field(
        1.0, description="Clip the global gradient norm to this; 0 turns clipping off.")
    gradient_checkpointing: bool = False
    blocks_to_swap: int = Field(
        0, ge=0, description="Memory saver: the denoiser's last N blocks stay in host memory "
        "and are streamed to the GPU as they run, the next one prefetched (use with "
        "gradient_checkpointing, or the blocks' weights stay alive for backward).")
    fused_backward: bool = Field(
        False, description="Memory saver: each parameter's optimizer step runs during backward "
        "as soon as its gradient is complete, and the gradient is freed at once (no gradient "
        "accumulation; max_grad_norm then clips each tensor on its own).")
    compile: bool = Field(False, description="torch.compile each block of the denoiser.")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="With several processes: ddp (each holds the whole model, gradients "
        "averaged) or fsdp (full fine-tunes: FSDP2 shards the weights, gradients and optimizer "
        "state over the processes; checkpoints are sharded and resume on any process count).")
    ema: EmaConfig = Field(default_factory=EmaConfig)
    seed: int = 42
    timesteps: Literal["uniform", "sigmoid", "shift", "flux_shift"] = Field(
        "sigmoid", description="How training timesteps are drawn."
    )
    sigmoid_mean: float = Field(0.0, description="Logit-normal mean (sigmoid, shift).")
    sigmoid_std: float = Field(1.0, gt=0, description="Logit-normal std (sigmoid, shift).")
    shift: float = Field(3.0, gt=0, description="Fixed shift for timesteps = \"shift\".")
    experts: list[str] | None = Field(
        None, description="Models of two experts (Wan 2.2 A14B: \"high\", \"low\"): the "
        "experts to train, in turn order, each with its own LoRA file; one name trains that "
        "expert alone. Default: all of them.")
    expert_switch_every: int = Field(
        10, ge=1, description="Models of two experts: optimizer steps each expert trains "
        "before the other takes its turn (each step trains one expert, on its side of the "
        "boundary; the idle one waits in host memory).")
    expert_boundary: float | None = Field(
        None, gt=0, lt=1, description="Models of two experts: the fraction of the schedule "
        "where the pipeline switches experts (its boundary_ratio; default the model's, 0.875 "
        "for Wan 2.2 T2V A14B): the high-noise expert trains the timesteps at or above it, "
        "the low-noise one those below, and samples switch there.")
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
    loss: Literal["l2", "huber", "smooth_l1"] = Field(
        "l2", description="Element-wise error: l2 (squared), huber (squared below "
        "huber_delta, linear above), smooth_l1 (huber / delta). See the README's Loss options.")
    huber_delta: float = Field(0.1, gt=0, description="huber / smooth_l1: where the error "
                               "turns from squared to linear (at the pure-noise end when "
                               "scheduled).")
    huber_schedule: Literal["constant", "exponential", "snr"] = Field(
        "constant", description="huber / smooth_l1: delta over timesteps (as sd-scripts): "
        "constant; exponential (1 at clean, huber_delta at pure noise); snr.")
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
    def _fused(self) -> "TrainConfig":
        if self.fused_backward and self.grad_accum > 1:
            raise ValueError("fused_backward steps each parameter inside backward, so gradients "
                             "cannot accumulate over micro-batches; set grad_accum = 1 (raise "
                             "batch_size instead) or fused_backward = false")
        if self.fused_backward and self.optimizer != "adamw":
            raise ValueError(f"fused_backward works with optimizer = \"adamw\", not "
                             f"\"{self.optimizer}\"; choose one of the two memory savers")
        return self

    @model_validator(mode="after")
    def _optimizer(self) -> "TrainConfig":
        problems = optimizers.problems(self)  # also checks optimizer_args' keys and types
        if problems:
            raise ValueError("; ".join(problems))
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
    every_n_steps: int | None = Field(None, ge=1, description="Sample every N steps.")
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
    format: Literal["diffusers", "kohya", "original"] | None = Field(
        None, description="diffusers/PEFT keys, kohya/ComfyUI keys, or the model's original "
        "module names under `diffusion_model.` (FLUX.2) (default: the family's own, the layout "
        "ComfyUI and diffusers both read fully: kohya for SDXL, original for FLUX.2, diffusers "
        "for the others).")
    dtype: DType = Field("bf16", description="dtype of the saved LoRA tensors.")
    dora_comfyui: bool = Field(
        True, description="DoRA runs: also write `<file>-comfyui.safetensors` beside each LoRA "
        "file, whose magnitudes give the trained weights under ComfyUI's (and Forge's) DoRA "
        "formula; the file without the suffix is for diffusers/peft, LyCORIS and difftune.")
    overwrite: bool = Field(False, description="Allow a new run in a folder holding a "
                            "previous run's outputs (its checkpoints are removed).")
    keep_best_mode: Literal["auto", "max", "min"] = Field(
        "auto", description="Whether the best is the largest or smallest value (auto: the "
        "metrics' own direction; needed when an expression mixes directions).")
    keep_best: str | None = Field(
        None, description="Keep <name>-best.safetensors: the LoRA of the step scoring best by "
        "this logged metric or weighted combination (val_loss, fidelity, clip_score, "
        "diversity, nearest_similarity; e.g. \"0.7*fidelity + 0.3*clip_score/100\").")

    @field_validator("keep_best")
    @classmethod
    def _keep_best(cls, text: str | None, info: ValidationInfo) -> str | None:
        """An expression of known metrics with one direction (a ValueError names why not)."""
        if text is not None:
            Measure(text, info.data.get("keep_best_mode", "auto"))
        return text
