"""Differential output preservation (`[preservation]`): the trigger-free captions' targets.

For each caption of a batch that holds the trigger, its trigger-free twin is trained too: the
adapter's prediction on it (batched with the batch's own forward) is pulled towards the base
model's (the adapter switched off, no gradient) on the same noisy latents and timesteps, taken
from the step's draw, so no extra random number is drawn and resume stays exact. One extra
forward, without gradient, per step; no second copy of the model.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from difftune.config.preservation import PreservationConfig
from difftune.data.discover import Item


def trigger_free(caption: str, cfg: PreservationConfig) -> str | None:
    """`caption` with every whole-word occurrence of the trigger replaced (and the spaces and
    commas left behind tidied), or None when it does not hold the trigger."""
    if not cfg.enabled:
        return None
    pattern = re.compile(rf"(?<!\w){re.escape(cfg.trigger.strip())}(?!\w)")
    if not pattern.search(caption):
        return None
    text = pattern.sub(cfg.replacement.strip(), caption)
    text = re.sub(r"\s+", " ", text)
    text = re.sub(r"\s+([,.;:])", r"\1", text)  # "a , b" -> "a, b"
    text = re.sub(r"([,;])(\s*[,;])+", r"\1", text)  # "a,, b" -> "a, b"
    return text.strip(" ,;")


def rows(captions: list[str], cfg: PreservationConfig) -> list[tuple[int, str]]:
    """(row, trigger-free caption) of each caption that holds the trigger."""
    out = []
    for r, caption in enumerate(captions):
        free = trigger_free(caption, cfg)
        if free is not None:
            out.append((r, free))
    return out


def unused(items: Sequence[Item], cfg: PreservationConfig) -> bool:
    """Whether output preservation is on but no caption (with its prefix and suffix) holds
    the trigger: it would then never act (a misspelt trigger, most likely)."""
    return cfg.enabled and not any(trigger_free(it.augment.fixed(it.caption), cfg) is not None
                                   for it in items)


def free_texts(texts: list[str], images: list, cfg: PreservationConfig
               ) -> tuple[list[str], list]:
    """The trigger-free twins of `texts` (with their images), to cache with them."""
    pairs = [(trigger_free(t, cfg), i) for t, i in zip(texts, images)]
    kept = [(t, i) for t, i in pairs if t is not None]
    return [t for t, _ in kept], [i for _, i in kept]


@contextmanager
def adapters_off(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Every peft adapter layer of `modules` switched off (the base model), then back as it
    was. Only the layers' on/off flag changes: no weight and no `requires_grad` is touched."""
    layers = [m for module in modules for m in module.modules() if isinstance(m, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    try:
        for layer in layers:
            layer._disable_adapters = True
        yield
    finally:
        for layer, was in zip(layers, before):
            layer._disable_adapters = was


def accumulate(extras: dict[str, list[float]], value: torch.Tensor) -> None:
    """Record one micro-batch's preservation loss for the step's metrics."""
    extras.setdefault("loss_preservation", []).append(float(value.detach()))


def step_metrics(extras: dict[str, list[float]]) -> dict[str, float]:
    """The step's recorded extras as means (and cleared for the next step)."""
    out = {k: sum(v) / len(v) for k, v in extras.items() if v}
    extras.clear()
    return out
