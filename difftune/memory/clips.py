"""The memory of training video clips, for `difftune check`: a clip's tokens and activations,
and on each common card the setting that fits it (the savers `estimate.fit` adds, gradient
checkpointing and block swap among them; else the most frames, else the largest resolution,
that fit with every saver). Arithmetic from parameter counts, as `estimate` is."""

from __future__ import annotations

from typing import Any, Mapping

from difftune.families.specs import FamilySpec, ModelSize
from difftune.memory.estimate import (CARDS, CLIP_FRAMES, LABEL, SAVERS, Setup, estimate, fit,
                                      latent_frames, tokens)


def _most_frames(values: Mapping[str, Any], size: ModelSize, spec: FamilySpec, gib: float,
                 trained: float | None) -> int | None:
    """The most frames (a count of the family's rule, below the configured one) that fit
    `gib` with the savers `fit` adds; None when not even one frame does."""
    assert spec.frame_rule is not None
    step, offset = spec.frame_rule
    frames = int(values[CLIP_FRAMES])
    for n in range((frames - offset) // step * step + offset - step, 0, -step):
        if fit({**values, CLIP_FRAMES: n}, size, spec, gib, trained).fits:
            return n
    return None


def _largest_side(values: Mapping[str, Any], size: ModelSize, spec: FamilySpec, gib: float,
                  trained: float | None) -> int | None:
    """The largest resolution (of the family's bucket step, below the configured one) at
    which the configured frames fit `gib` with the savers `fit` adds; None if none does."""
    side = max((int(r) for k, r in values.items() if k.endswith(".resolution")
                and not isinstance(r, list)), default=1024)
    for res in range(side - spec.bucket_step, 63, -spec.bucket_step):
        changed = {k: (res if k.endswith(".resolution") else v) for k, v in values.items()}
        if fit(changed, size, spec, gib, trained).fits:
            return res
    return None


def card_advice(values: Mapping[str, Any], size: ModelSize, spec: FamilySpec, gib: float,
                trained: float | None = None) -> str:
    """What makes the clip fit `gib`: the config as it is, the savers, else fewer frames,
    else a lower resolution (each with the savers they need)."""
    f = fit(values, size, spec, gib, trained)
    if f.fits:
        return f"{gib} GiB " + (f"with {', '.join(f.savers)}" if f.savers else "as it is")
    frames = _most_frames(values, size, spec, gib, trained)
    if frames is not None:
        with_ = fit({**values, CLIP_FRAMES: frames}, size, spec, gib, trained).savers
        return f"{gib} GiB with at most {frames} frames" + (
            f" and {', '.join(with_)}" if with_ else "")
    side = _largest_side(values, size, spec, gib, trained)
    if side is not None:
        return f"{gib} GiB at resolution {side} or less, with every saver"
    return f"not {gib} GiB at any resolution or frame count"


def clip_line(values: Mapping[str, Any], size: ModelSize, spec: FamilySpec,
              trained: float | None = None) -> str:
    """`clip memory: ...`: the longest clip's tokens and activations as configured, and on
    each card what fits (see `card_advice`)."""
    setup = Setup.from_values(values, trained)
    est = estimate(size, spec, setup)
    found = tokens(size, spec, setup)
    cards = "; ".join(card_advice(values, size, spec, gib, trained) for gib in CARDS)
    return (f"clip memory: the longest clip ({setup.frames} frames, "
            f"{latent_frames(spec, setup.frames)} latent frames, at {setup.resolution}x"
            f"{setup.resolution}) is {found:,} tokens a sample; activations "
            f"{est.activations:.1f} GiB at batch {setup.batch}, peak {est.peak:.1f} GiB; fits "
            f"{cards} ({LABEL})")

