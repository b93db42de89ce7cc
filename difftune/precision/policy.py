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
    # Per text encoder (precision.text_encoders as a table): its own dtype, cast to after load
    # (the loaders read every encoder in `text_encoders`), and which ones are stored in fp8.
    encoder_dtypes: tuple[tuple[str, torch.dtype], ...] = ()
    fp8_encoders: frozenset[str] = frozenset()
    # Where the denoiser is loaded when not on `device`: the host, when block swap will place
    # it part by part (it need never fit on the GPU whole).
    denoiser_device: torch.device | None = None

    @property
    def denoiser_home(self) -> torch.device:
        """The device the denoiser is loaded to."""
        return self.denoiser_device or self.device

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, device: torch.device) -> "PrecisionPolicy":
        """Map config names to torch dtypes (fp8 storage computes in the mixed dtype)."""
        mixed = None if cfg.mixed == "no" else DTYPES[cfg.mixed]
        # fp8 storage computes in the mixed dtype, except a VAE under fp16: VAEs overflow in
        # fp16 (SDXL's notably), and the VAE only runs while caching and sampling.
        compute = {p: mixed or torch.float32 for p in PARTS}
        if mixed == torch.float16:
            compute["vae"] = torch.float32
        def load_dtype(name: str) -> torch.dtype:
            return compute["denoiser"] if name == "fp8" else DTYPES[name]

        per_encoder = cfg.text_encoders if isinstance(cfg.text_encoders, dict) else {}
        uniform = {"denoiser": cfg.denoiser, "vae": cfg.vae,
                   "text_encoders": cfg.text_encoders if not per_encoder else "fp32"}
        load = {p: compute[p] if v == "fp8" else DTYPES[v] for p, v in uniform.items()}
        if per_encoder and len({load_dtype(v) for v in per_encoder.values()}) == 1:
            load["text_encoders"] = load_dtype(next(iter(per_encoder.values())))
        fp8 = frozenset(p for p, v in uniform.items() if v == "fp8")
        return cls(device, mixed, load["denoiser"], load["text_encoders"], load["vae"], fp8,
                   tuple((n, load_dtype(v)) for n, v in sorted(per_encoder.items())),
                   frozenset(n for n, v in per_encoder.items() if v == "fp8"))

    def encoder_dtype(self, name: str) -> torch.dtype:
        """The dtype text encoder `name` is kept and computed in (fp32 when a per-encoder
        table leaves it out)."""
        if not self.encoder_dtypes:
            return self.text_encoders
        return dict(self.encoder_dtypes).get(name, torch.float32)

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
