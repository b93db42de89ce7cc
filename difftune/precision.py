"""The dtype policy of a run: storage dtype per component and the autocast dtype.

Trainable parameters (LoRA) always stay fp32; frozen weights are stored in the dtype the config
names; the forward pass runs under autocast in the mixed dtype when one is set.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from difftune.config import PrecisionConfig

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


PARTS = ("denoiser", "text_encoders", "vae")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Resolved dtypes and the device they apply to.

    `denoiser`, `text_encoders` and `vae` are the dtypes weights are loaded and computed in;
    the parts named in `fp8` are then stored as float8 e4m3fn between uses (lowbit.py).
    """

    device: torch.device
    mixed: torch.dtype | None
    denoiser: torch.dtype
    text_encoders: torch.dtype
    vae: torch.dtype
    fp8: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, device: torch.device) -> "PrecisionPolicy":
        """Map config names to torch dtypes (fp8 storage computes in the mixed dtype)."""
        mixed = None if cfg.mixed == "no" else DTYPES[cfg.mixed]
        # fp8 storage computes in the mixed dtype, except a VAE under fp16: VAEs overflow in
        # fp16 (SDXL's notably), and the VAE only runs while caching and sampling.
        compute = {p: mixed or torch.float32 for p in PARTS}
        if mixed == torch.float16:
            compute["vae"] = torch.float32
        load = {p: compute[p] if getattr(cfg, p) == "fp8" else DTYPES[getattr(cfg, p)]
                for p in PARTS}
        fp8 = frozenset(p for p in PARTS if getattr(cfg, p) == "fp8")
        return cls(device, mixed, load["denoiser"], load["text_encoders"], load["vae"], fp8)

    @property
    def compute(self) -> torch.dtype:
        """dtype that inputs to the frozen model are cast to."""
        return self.mixed or torch.float32

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Autocast to the mixed dtype on the run's device, or nothing when mixed = "no"."""
        if self.mixed is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.mixed):
            yield


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; "cuda" without CUDA is a clear error."""
    from difftune.errors import EnvironmentProblem

    if name == "cuda" and not torch.cuda.is_available():
        raise EnvironmentProblem(
            "train.device = \"cuda\" but no CUDA device is visible to PyTorch; "
            "set train.device = \"cpu\" or \"auto\", or install a CUDA build of torch"
        )
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
