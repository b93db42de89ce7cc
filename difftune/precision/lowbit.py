"""Low-bit frozen weights: fp8 storage and weight-only quantization, before the LoRA goes on.

fp8 storage keeps Linear weights as float8 e4m3fn and casts them up to the compute dtype inside
each product (`Fp8Linear`, whose backward saves the fp8 weight, not an up-cast copy).
Quantization replaces Linear weights: int8 / fp8 through torchao, qint8 / qfloat8 through
optimum-quanto, nf4 through bitsandbytes (CUDA). peft then wraps the low-bit layers, so the
LoRA trains in fp32 on top of them.

What must stay in high precision is declared by each family (`Family.keep_high`: module-name
patterns per part), never found by probing attributes: embedding lookups, norms, timestep and
input/output projections. Embeddings and norms are not Linear layers, so neither fp8 storage
nor quantization ever touches them (no embedding lookup on fp8, no norm in a dtype it cannot take).
"""

from __future__ import annotations

import logging
import re
from typing import Callable, Iterable

import torch

from difftune.config import QuantizeConfig
from difftune.families.base import Components, Family
from difftune.precision.policy import PrecisionPolicy

log = logging.getLogger("difftune")
FP8 = torch.float8_e4m3fn


def _kept(patterns: Iterable[str]) -> Callable[[str], bool]:
    """A predicate: does a module name match one of the family's keep-high patterns?"""
    compiled = [re.compile(p) for p in patterns]
    return lambda name: any(c.search(name) for c in compiled)


class _Fp8Matmul(torch.autograd.Function):
    """x @ W.T + b with W stored in fp8: cast up for the product, and again in backward.

    Only the fp8 weight is saved for backward (not its up-cast copy), so training keeps the
    memory saving; the weight is frozen, so only the input's gradient is computed.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                compute: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(weight)
        ctx.compute, ctx.x_dtype = compute, x.dtype
        w = weight.to(compute)
        return torch.nn.functional.linear(x.to(compute), w,
                                          None if bias is None else bias.to(compute))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        (weight,) = ctx.saved_tensors
        grad_x = grad.to(ctx.compute) @ weight.to(ctx.compute)
        return grad_x.to(ctx.x_dtype), None, None, None


class Fp8Linear(torch.nn.Linear):
    """A frozen Linear whose weight is stored as float8 e4m3fn and computed in `compute`.

    A subclass of `nn.Linear`, so peft puts a LoRA on it like on any Linear layer.
    """

    compute: torch.dtype

    @classmethod
    def from_linear(cls, old: torch.nn.Linear, compute: torch.dtype) -> "Fp8Linear":
        """The fp8 twin of a Linear layer (its weight cast once; the bias kept as it is)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features, new.compute = old.in_features, old.out_features, compute
        new.weight = torch.nn.Parameter(old.weight.detach().to(FP8), requires_grad=False)
        new.bias = old.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output in the compute dtype (autocast is not needed to cast fp8)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return _Fp8Matmul.apply(x, self.weight, self.bias, self.compute)


def store_fp8(module: torch.nn.Module, compute: torch.dtype, keep: Iterable[str]) -> int:
    """Store the module's Linear weights (all but the kept-high ones) in fp8; returns how many.

    Convolutions keep their dtype: the denoisers' weights are almost all in Linear layers.
    """
    kept = _kept(keep)
    names = [n for n, m in module.named_modules()
             if type(m) is torch.nn.Linear and not kept(n)]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, Fp8Linear.from_linear(getattr(parent, child), compute))
    return len(names)


def quantize(module: torch.nn.Module, method: str, compute: torch.dtype,
             keep: Iterable[str]) -> int:
    """Weight-only quantize the module's Linear layers not kept high; returns how many."""
    kept = _kept(keep)
    names = [n for n, m in module.named_modules()
             if isinstance(m, torch.nn.Linear) and not kept(n)]
    if not names:
        return 0
    if method in ("int8", "fp8"):
        from torchao.quantization import (Float8WeightOnlyConfig, Int8WeightOnlyConfig,
                                          quantize_)

        config = Int8WeightOnlyConfig() if method == "int8" else Float8WeightOnlyConfig()
        wanted = set(names)
        quantize_(module, config, filter_fn=lambda m, fqn: fqn in wanted)
    elif method in ("qint8", "qfloat8"):
        from optimum import quanto

        # quanto dequantizes to the weights' dtype, which must be the one autocast computes in.
        module.to(compute)

        weights = quanto.qint8 if method == "qint8" else quanto.qfloat8
        quanto.quantize(module, weights=weights, include=names)
        quanto.freeze(module)
    elif method == "nf4":
        _to_nf4(module, names, compute)
    else:  # config validation admits only the methods above
        raise AssertionError(f"unknown quantization {method!r}")
    return len(names)


def _to_nf4(module: torch.nn.Module, names: list[str], compute: torch.dtype) -> None:
    """Replace Linear layers by bitsandbytes 4-bit NF4 layers (quantized when moved to CUDA)."""
    import bitsandbytes as bnb

    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        old = getattr(parent, child)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=old.bias is not None,
                                compute_dtype=compute, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(old.weight.data.cpu(), requires_grad=False,
                                       quant_type="nf4")
        if old.bias is not None:
            new.bias = torch.nn.Parameter(old.bias.data.cpu(), requires_grad=False)
        setattr(parent, child, new.to(old.weight.device if old.weight.is_cuda else "cuda"))


def apply_to_components(comps: Components, family: Family, policy: PrecisionPolicy,
                        q: QuantizeConfig) -> None:
    """fp8 storage and quantization of the loaded base, as the config asks, before any LoRA.

    Adds a precision tag to the fingerprint for the parts whose outputs are cached (VAE, text
    encoders), so a cache entry made at one precision is never read at another.
    """
    for part, modules, compute in (
            ("denoiser", {"denoiser": comps.denoiser}, policy.compute),
            ("vae", {"vae": comps.vae}, policy.vae),  # its load dtype is its compute dtype
            ("text_encoders", comps.text_encoders, policy.compute)):
        apply_to_part(part, modules, family, policy, getattr(q, part, "none"), compute)
    comps.fingerprint += precision_tag(policy, q)


def apply_to_part(part: str, modules: dict[str, torch.nn.Module], family: Family,
                  policy: PrecisionPolicy, method: str, compute: torch.dtype) -> None:
    """One part's modules (e.g. every text encoder): fp8 storage or quantization, or nothing."""
    keep = family.keep_high.get(part, ())
    for name, module in modules.items():
        if module is None:
            continue
        if part == "text_encoders" and policy.encoder_dtypes:
            module.to(policy.encoder_dtype(name))  # its own dtype (a per-encoder table)
        if part in policy.fp8 or (part == "text_encoders" and name in policy.fp8_encoders):
            count = store_fp8(module, compute, keep)
            log.info("%s: %d linear layers stored in fp8, computed in %s", name, count, compute)
        elif method != "none":
            count = quantize(module, method, compute, keep)
            log.info("%s: %d linear layers quantized (%s)", name, count, method)


def precision_tag(policy: PrecisionPolicy, q: QuantizeConfig) -> str:
    """What in the precision set-up changes cached outputs (VAE, text encoders), beyond the
    dtypes already in every cache key; empty for plain settings, so their keys stay as they were."""
    if not (policy.fp8 & {"vae", "text_encoders"} or policy.fp8_encoders
            or q.text_encoders != "none"):
        return ""
    fp8 = sorted(policy.fp8 & {"vae", "text_encoders"} | policy.fp8_encoders)
    return f"|fp8={','.join(fp8)}|te_quant={q.text_encoders}"
