"""The optimizers `train.optimizer` can name: one table of light facts (no torch).

Each `OptimizerSpec` says where the optimizer comes from (its library), which options
`train.optimizer_args` may give it (a pydantic model: names, types, defaults), which of the
shared fields train.betas / eps / weight_decay it reads, whether it runs on CUDA only, how the
run's lr schedule applies to it, and how many bytes of state it keeps per weight. The config
validates against this table before anything loads; `build.py` constructs each optimizer from
its library. Adding an optimizer is one args model, one spec here and one builder there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    from difftune.config.sections import TrainConfig

Shape = tuple[int, ...]
# How train.scheduler / train.warmup_steps reach an optimizer: "full" (the run's warm-up and
# decay scale its lr), "own_warmup" (its own warm-up, no decay: schedule-free) or "none" (it
# computes its own step size: Adafactor's relative step).
Schedule = Literal["full", "own_warmup", "none"]
SHARED = ("betas", "eps", "weight_decay")
Beta = Annotated[float, Field(ge=0, lt=1)]  # a moving average's decay
Positive = Annotated[float, Field(gt=0)]


class Args(BaseModel):
    """Base of every optimizer's options: unknown keys refused, finite numbers only, and no
    mixing of switches and numbers (pydantic would read true as 1.0, or 1 and "yes" as true)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _switches_are_booleans(cls, data: object) -> object:
        for key, value in (data.items() if isinstance(data, dict) else ()):
            field = cls.model_fields.get(key)
            if field is None:
                continue
            switch = field.annotation is bool
            if switch != isinstance(value, bool):
                kind = "true or false" if switch else "a number, not true/false"
                raise ValueError(f"{key}: write {kind}")
        return data


class NoArgs(Args):
    """AdamW and schedule-free take train.betas / eps / weight_decay and nothing more here."""


class EightBitArgs(Args):
    """bitsandbytes' 8-bit optimizers."""

    min_8bit_size: int = Field(4096, ge=1, description="Weights with fewer elements keep "
                               "32-bit state (bitsandbytes' default).")
    percentile_clipping: int = Field(100, ge=1, le=100, description="Clip gradients at this "
                                     "percentile of the last 100 norms (100: off).")


class ProdigyArgs(Args):
    """prodigyopt.Prodigy: estimates the step size D; lr multiplies it (start from 1.0)."""

    d_coef: float = Field(1.0, gt=0, description="Multiplier of the estimated step size.")
    d0: float = Field(1e-6, gt=0, description="Initial step-size estimate.")
    growth_rate: float | None = Field(None, gt=1, description="Cap on D's growth per step "
                                      "(unset: unbounded, the library's default).")
    beta3: float | None = Field(None, ge=0, lt=1, description="EMA of the D estimate "
                                "(unset: sqrt(beta2)).")
    use_bias_correction: bool = False
    safeguard_warmup: bool = Field(False, description="Recommended with a warm-up.")
    decouple: bool = Field(True, description="AdamW-style decoupled weight decay.")
    slice_p: int = Field(1, ge=1, description="Estimate D on every p-th element (saves memory).")


class AdafactorArgs(Args):
    """transformers.optimization.Adafactor."""

    relative_step: bool = Field(False, description="Its own step size (1/sqrt(step), capped "
                                "at 1e-2); train.lr and the schedule are then not used.")
    scale_parameter: bool = Field(False, description="Scale the step by each weight's RMS.")
    warmup_init: bool = Field(False, description="relative_step's warm-up (1e-6 * step).")
    clip_threshold: float = Field(1.0, gt=0)
    decay_rate: float = Field(-0.8, lt=0, description="Second-moment decay exponent.")
    beta1: float | None = Field(None, ge=0, lt=1, description="First moment (unset: none, "
                                "the memory-lean default).")
    eps: tuple[Positive, Positive] = Field((1e-30, 1e-3), description="Regularizers "
                                           "(gradient, parameter scale).")

    @model_validator(mode="after")
    def _warmup_init(self) -> "AdafactorArgs":
        if self.warmup_init and not self.relative_step:
            raise ValueError("warmup_init needs relative_step = true (it is relative_step's "
                             "warm-up); set both or neither")
        return self


class ScheduleFreeArgs(Args):
    """schedulefree.AdamWScheduleFree (betas, eps, weight_decay from train)."""

    r: float = Field(0.0, ge=0, description="Polynomial weighting power of the average.")
    weight_lr_power: float = Field(2.0, ge=0, description="Weight of each step in the "
                                   "average by lr ** this during warm-up.")


class CameArgs(Args):
    """came_pytorch.CAME (three betas and two eps of its own)."""

    betas: tuple[Beta, Beta, Beta] = (0.9, 0.999, 0.9999)
    eps: tuple[Positive, Positive] = (1e-30, 1e-16)
    clip_threshold: float = Field(1.0, gt=0)


class LionArgs(Args):
    """lion_pytorch.Lion (betas and weight_decay from train)."""

    decoupled_weight_decay: bool = False


def _adamw(shape: Shape, args: Args) -> float:
    return 2 * math.prod(shape)  # exp_avg, exp_avg_sq


def _eight_bit(moments: int) -> Callable[[Shape, Args], float]:
    def elements(shape: Shape, args: Args) -> float:
        n = math.prod(shape)
        if n < args.min_8bit_size:  # type: ignore[attr-defined]
            return moments * n  # 32-bit state
        # One byte per moment and element, one float32 absmax per 256-element block, and the
        # 256-entry float32 quantization map of each moment: in 4-byte units.
        return moments * (n / 4 + math.ceil(n / 256) + 256)
    return elements


def _prodigy(shape: Shape, args: Args) -> float:
    n = math.prod(shape)
    sliced = math.ceil(n / args.slice_p)  # type: ignore[attr-defined]
    # exp_avg, exp_avg_sq, s and p0 (a weight that is all zeros at its first step, such as a
    # LoRA up matrix, keeps a scalar p0 instead: this is the upper bound).
    return 2 * n + 2 * sliced


def _factored(shape: Shape, moments: int) -> float:
    """Adafactor-style second moments: a row and a column vector per matrix, `moments` of them."""
    if len(shape) < 2:
        return math.prod(shape)
    return moments * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]))


def _adafactor(shape: Shape, args: Args) -> float:
    first = math.prod(shape) if args.beta1 is not None else 0  # type: ignore[attr-defined]
    return first + _factored(shape, 1)


def _came(shape: Shape, args: Args) -> float:
    # exp_avg, plus the factored second moment and the factored residual (2-D and up).
    return math.prod(shape) + _factored(shape, 2)


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: its library, options, shared fields read, and rules."""

    name: str
    library: str  # the package a user installs (pip name)
    args: type[Args]
    takes: tuple[str, ...]  # which of train.betas / eps / weight_decay it reads
    defaults: dict[str, object]  # its own defaults for those fields, where train's differ
    state: Callable[[Shape, Args], float]  # state elements per weight of this shape
    cuda_only: bool = False
    single_lr: bool = False  # every group at one lr (Prodigy refuses others)
    start_lr: float | None = None  # where its library says to start, when it is not AdamW's
    rule: Callable[[Args], Schedule] = lambda args: "full"
    # Whether it steps FSDP's sharded (DTensor) weights: elementwise updates do; factored
    # second moments (Adafactor, CAME) mix plain and sharded tensors, and bitsandbytes' kernels
    # take plain tensors only (Adafactor and CAME were run sharded and failed).
    shards: bool = True

    def schedule(self, args: Args) -> Schedule:
        """How the run's lr schedule applies with these options."""
        return self.rule(args)


def _relative(args: Args) -> Schedule:
    return "none" if args.relative_step else "full"  # type: ignore[attr-defined]


OPTIMIZERS: dict[str, OptimizerSpec] = {s.name: s for s in (
    OptimizerSpec("adamw", "torch", NoArgs, SHARED, {}, _adamw),
    OptimizerSpec("adamw8bit", "bitsandbytes", EightBitArgs, SHARED, {}, _eight_bit(2),
                  cuda_only=True, shards=False),
    OptimizerSpec("prodigy", "prodigyopt", ProdigyArgs, SHARED, {"weight_decay": 0.0},
                  _prodigy, single_lr=True, start_lr=1.0),
    OptimizerSpec("adafactor", "transformers", AdafactorArgs, ("weight_decay",),
                  {"weight_decay": 0.0}, _adafactor, rule=_relative, shards=False),
    OptimizerSpec("schedulefree_adamw", "schedulefree", ScheduleFreeArgs, SHARED,
                  {"weight_decay": 0.0}, _adamw, rule=lambda args: "own_warmup"),
    OptimizerSpec("came", "came-pytorch", CameArgs, ("weight_decay",), {"weight_decay": 0.0},
                  _came, shards=False),
    OptimizerSpec("lion", "lion-pytorch", LionArgs, ("betas", "weight_decay"),
                  {"betas": (0.9, 0.99), "weight_decay": 0.0}, lambda s, a: math.prod(s)),
    OptimizerSpec("lion8bit", "bitsandbytes", EightBitArgs, ("betas", "weight_decay"),
                  {"betas": (0.9, 0.99), "weight_decay": 0.0}, _eight_bit(1), cuda_only=True,
                  shards=False),
)}
OptimizerName = Literal["adamw", "adamw8bit", "prodigy", "adafactor", "schedulefree_adamw",
                        "came", "lion", "lion8bit"]


def parse_args(name: str, given: dict[str, object]) -> Args:
    """`train.optimizer_args` read as `name`'s typed options; a ValueError naming the bad key
    and the accepted ones otherwise."""
    spec = OPTIMIZERS[name]
    accepted = list(spec.args.model_fields)
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        takes = ", ".join(accepted) if accepted else "none"
        raise ValueError(f"train.optimizer_args.{unknown[0]}: {name} has no option "
                         f"\"{unknown[0]}\"; its options: {takes}")
    try:
        return spec.args(**given)
    except ValidationError as err:
        first = err.errors()[0]
        where = "".join(f".{p}" for p in first["loc"])
        msg = first['msg'].removeprefix('Value error, ')
        raise ValueError(f"train.optimizer_args{where}: {msg} (for {name})") from None


def shared_value(train: "TrainConfig", field: str) -> object:
    """train.betas / eps / weight_decay as the optimizer gets it: the config's value when set
    there, else the optimizer's own default (Lion's betas differ from AdamW's)."""
    spec = OPTIMIZERS[train.optimizer]
    if field in train.model_fields_set or field not in spec.defaults:
        return getattr(train, field)
    return spec.defaults[field]


def problems(train: "TrainConfig") -> list[str]:
    """Option conflicts refused at load (each message names the field and the fix)."""
    name, out, given = train.optimizer, [], train.model_fields_set
    schedule = OPTIMIZERS[name].schedule(parse_args(name, train.optimizer_args))
    if schedule == "none":
        clash = [f"train.{f}" for f in ("lr", "scheduler", "warmup_steps") if f in given]
        if clash:
            out.append(f"{', '.join(clash)}: {name} with these optimizer_args computes its own "
                       "step size (adafactor's relative_step) and never reads them; remove "
                       "them, or set optimizer_args.relative_step = false to use them")
    if schedule == "own_warmup" and train.scheduler != "constant":
        out.append(f"train.scheduler = \"{train.scheduler}\": {name} replaces the lr schedule "
                   "by its own averaging (a decay would fight it); set scheduler = "
                   "\"constant\" (train.warmup_steps is its own warm-up)")
    return out


def warnings(train: "TrainConfig") -> list[str]:
    """Fields set in the config that this optimizer does not read, and an lr far from where
    the optimizer's own documentation starts (each worth a warning)."""
    spec = OPTIMIZERS[train.optimizer]
    out = []
    if spec.start_lr and train.lr < spec.start_lr / 10:  # Prodigy: lr scales its own estimate
        out.append(f"train.lr = {train.lr} is far below the lr {spec.name}'s library "
                   f"recommends ({spec.start_lr}): it multiplies the step size {spec.name} "
                   "estimates; see the README's Optimizers")
    return out + [f"train.{f} is ignored by optimizer = \"{spec.name}\" (it does not take it"
            + ("; set its own in train.optimizer_args" if f in spec.args.model_fields else "")
            + ")" for f in SHARED if f in train.model_fields_set and f not in spec.takes]


def state_bytes(name: str, args: Args, shapes: list[Shape], element_size: int = 4) -> int:
    """Bytes of optimizer state for weights of `shapes` (state kept in the weights' dtype of
    `element_size` bytes, as these libraries do; 8-bit state counted in its own sizes), per
    weight tensors only (scalars such as step counts left out)."""
    spec = OPTIMIZERS[name]
    if spec.cuda_only:  # counted in 4-byte units above, whatever the weight dtype
        return int(sum(spec.state(s, args) for s in shapes) * 4)
    return int(sum(spec.state(s, args) for s in shapes) * element_size)
