"""The base of every config section, and the field types several sections share."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


class Section(BaseModel):
    """Base of every section: unknown keys are an error, assignments are validated, and no
    float may be inf or NaN (TOML can write both; a run with `lr = inf` trains to NaN)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# An Adam beta: the decay of a moving average, which needs 0 <= beta < 1 (1 never forgets the
# first gradient, and above 1 the average grows without bound).
Beta = Annotated[float, Field(ge=0, lt=1)]


def _no_bool(value: Any) -> Any:
    """Refuse true/false where a number is meant (pydantic would read true as 1.0); None (off,
    as config.resolved.json writes it) is read as 0 for the bound check."""
    if isinstance(value, bool):
        raise ValueError("write a number: a positive norm to clip to, or 0 to turn clipping off")
    return 0.0 if value is None else value


def _zero_is_off(value: float | None) -> float | None:
    """0 means off, which the code reads as None (TOML cannot write None)."""
    return None if value == 0 else value


# A gradient-norm limit: a positive number, or 0 for no clipping (held as None).
ClipNorm = Annotated[float | None, BeforeValidator(_no_bool), Field(ge=0),
                     AfterValidator(_zero_is_off)]


# Which library quantizes each setting (and the pip package a user installs for it).
QUANT_BACKENDS: dict[str, tuple[str, str]] = {
    "int8": ("torchao", "torchao"), "fp8": ("torchao", "torchao"),
    "qint8": ("optimum.quanto", "optimum-quanto"), "qfloat8": ("optimum.quanto", "optimum-quanto"),
    "nf4": ("bitsandbytes", "bitsandbytes"),
}
