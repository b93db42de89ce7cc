"""Helpers the unit tests share: which modules carry a LoRA, the warnings and log records
diffusers emits while it reads a file (a reader that complains has not read it all), whether
a module loaded from files holds exactly the weights it was written from, and the all-CPU
float32 placement the exact comparisons with the pipelines use."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch
from peft.tuners.lora import LoraLayer


def cpu_policy() -> object:
    """A placement policy (as the families' `prepare` reads one) keeping everything on the
    CPU in float32: the exact comparisons with the pipelines run there."""
    cpu = torch.device("cpu")
    return type("Policy", (), {"device": cpu, "denoiser_home": cpu, "denoiser": torch.float32,
                               "vae": torch.float32, "text_encoders": torch.float32})()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """`a` and `b` hold the same tensors under the same names, bit for bit (a difference names
    its tensor)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def lora_modules(model: torch.nn.Module) -> set[str]:
    """Names of the modules that carry a peft LoRA layer."""
    return {n for n, m in model.named_modules() if isinstance(m, LoraLayer)}


class _Collect(logging.Handler):
    """Keeps every record at WARNING or above."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def problems() -> Iterator[list[str]]:
    """Collect diffusers/peft warnings (logged or warned) raised inside the block."""
    handler = _Collect()
    loggers = [logging.getLogger(n) for n in ("diffusers", "peft")]
    for lg in loggers:
        lg.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield handler.messages
        finally:
            for lg in loggers:
                lg.removeHandler(handler)
    ignored = (DeprecationWarning, FutureWarning)
    handler.messages.extend(str(w.message) for w in caught if not issubclass(w.category, ignored))
