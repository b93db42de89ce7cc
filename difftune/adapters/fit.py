"""Whether a LoRA or LyCORIS file fits a model: every module's update has the shape of the
weight it adapts.

A file made for another model (another family, flavor or size) names modules this model has,
with factors of other sizes. Readers fail on it deep inside (LyCORIS with "The size of tensor
a (16) must match the size of tensor b (3)"), or, as peft does when diffusers loads it, skip
the module and sample without it. `check_fit` refuses such a file first, naming the tensor,
its shape and the model's weight.

Shapes are compared as matrices: an update is `rows x cols`, rows the weight's output axis
and cols everything else (in features, times the kernel of a conv), which is how every kind
builds it. Per kind, in LyCORIS's tensor names (peft's `lora_A`/`lora_B` are LoRA's down/up):
- LoRA/LoCon: `lora_up` (out, r, ...) @ `lora_down` (r, in, ...), or peft's `lora_B` @
  `lora_A` (a Tucker `lora_mid` is left to LyCORIS: difftune never writes one).
- LoHa: (`hada_w1_a` @ `hada_w1_b`) * (`hada_w2_a` @ `hada_w2_b`), both products of the shape.
- LoKr: kron(w1, w2), each whole (`lokr_w1`, `lokr_w2`) or a product (`_a` @ `_b`):
  rows multiply, cols multiply.
- DoRA: `dora_scale` holds one magnitude per output row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from difftune.adapters.formats import LORA_A, LORA_B, with_clip_root
from difftune.adapters.lycoris_files import needs_lycoris, prefixes
from difftune.errors import CheckpointError
from difftune.families.base import Components, Family
from difftune.families.common.text import file_clip_roots, model_clip_roots


@dataclass(frozen=True)
class Axis:
    """One axis of a module's update: its size and the file tensors it comes from."""

    size: int
    tensors: tuple[str, ...]


def component_modules(family: Family, comps: Components) -> dict[str, torch.nn.Module]:
    """{component prefix ("transformer", "text_encoder_2"): its loaded module}: the parts a
    file's modules may adapt (the denoiser and every loaded text encoder)."""
    out = {family.denoiser_prefix: comps.denoiser}
    out |= {family.text_encoder_prefixes[n]: m for n, m in comps.text_encoders.items()
            if m is not None}
    return out


def check_fit(label: str, tensors: dict[str, torch.Tensor], family: Family,
              comps: Components, metadata: dict[str, str] | None = None) -> None:
    """Refuse (CheckpointError) a file whose modules' factors do not fit the model's weights;
    `label` names the file in the message (`--lora PATH`). Modules the model lacks are left
    to the reader's own report; a file the family refuses for another kind of its model
    (`Family.lora_refusal`, from its tensors and header `metadata`) is refused with the
    family's reason."""
    why = family.lora_refusal(comps, tensors, metadata)
    if why is not None:
        raise CheckpointError(f"{label}: {why}")
    if needs_lycoris(tensors):
        grouped, live = _group(tensors, "."), _lycoris_modules(family, comps)
    else:
        try:
            state, _ = family.lora_from_format(comps, tensors)
        except CheckpointError:  # a layout only diffusers' own converters read: its loader
            return               # reports what does not fit
        state = with_clip_root(state, model_clip_roots(family, comps))
        grouped = {m: {s: v for s, v in parts.items() if s in (LORA_A, LORA_B)}
                   for m, parts in _group(state, ".lora_").items()}
        live = {m: mod for m in grouped if (mod := _submodule(family, comps, m)) is not None}
    for module, parts in grouped.items():
        if module in live:
            _check_module(label, module, parts, _weight_shape(live[module]))


def _group(tensors: dict[str, torch.Tensor], sep: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module: {suffix: tensor}}, splitting each key at the first `sep` (its second part
    keeps `sep` without its leading dot)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, found, suffix = key.partition(sep)
        if found:
            out.setdefault(module, {})[(sep + suffix).removeprefix(".")] = value
    return out


def _lycoris_modules(family: Family, comps: Components) -> dict[str, torch.nn.Module]:
    """{LyCORIS file module name: live module} of every module with a weight."""
    names, roots = prefixes(family), file_clip_roots(family)
    out: dict[str, torch.nn.Module] = {}
    for prefix, model in component_modules(family, comps).items():
        for name, module in model.named_modules():
            if name and isinstance(getattr(module, "weight", None), torch.Tensor):
                key = next(iter(with_clip_root({f"{prefix}.{name}": 0}, roots)))
                out[f"{names[prefix]}_{key.partition('.')[2].replace('.', '_')}"] = module
    return out


def _submodule(family: Family, comps: Components, name: str) -> torch.nn.Module | None:
    """The live module `<component prefix>.<module path>` names, or None."""
    prefix, _, path = name.partition(".")
    model = component_modules(family, comps).get(prefix)
    try:
        return model.get_submodule(path) if model is not None and path else None
    except AttributeError:
        return None


def _weight_shape(module: torch.nn.Module) -> tuple[int, ...]:
    """The logical shape of a module's weight: (out, in) for a linear layer, whatever its
    storage (a quantized layer may pack it), (out, in / groups, *kernel) for a conv."""
    if isinstance(module, BaseTunerLayer):
        module = module.get_base_layer()
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return int(module.out_features), int(module.in_features)
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return (module.out_channels, module.in_channels // module.groups, *module.kernel_size)
    return tuple(module.weight.shape)


class _Unfit(Exception):
    """A module's factors that do not multiply (the message says which)."""


_TUCKER = ("lora_mid.weight", "hada_t1", "hada_t2", "lokr_t1", "lokr_t2")


def _check_module(label: str, module: str, parts: dict[str, torch.Tensor],
                  weight: tuple[int, ...]) -> None:
    """Refuse one module whose update's rows or columns differ from its weight's."""
    if any(t in parts for t in _TUCKER):
        return  # difftune writes no Tucker factors; LyCORIS checks its own (`apply_file`)
    try:
        terms = _terms(parts)
    except _Unfit as err:
        raise CheckpointError(f"{label}: {module}: {err}; the file is damaged or not a LoRA "
                              "of a kind difftune reads") from None
    wanted = (weight[0], math.prod(weight[1:]))
    for axis, (what, means) in enumerate((("rows", "its output features"),
                                          ("columns", "its input features times kernel"))):
        for term in terms:
            got = term[axis]
            if got is not None and got.size != wanted[axis]:
                shapes = " and ".join(f"{module}.{t} has shape {tuple(parts[t].shape)}"
                                      for t in got.tensors)
                raise CheckpointError(
                    f"{label}: {shapes}, making an update of {got.size} {what}, but the "
                    f"model's weight there has shape {weight}: {wanted[axis]} {what} ({means})"
                    "; the file was made for another model (family, flavor or size): use it "
                    "with the base model it was trained on")


def _terms(parts: dict[str, torch.Tensor]) -> list[tuple[Axis, Axis | None]]:
    """The (rows, cols) of each matrix a module's update is built from (cols None where a
    tensor fixes only the rows)."""
    terms: list[tuple[Axis, Axis | None]] = []
    for up, down in (("lora_up.weight", "lora_down.weight"), (LORA_B, LORA_A)):
        if up in parts or down in parts:
            terms.append(_product(parts, up, down))
    if any(k.startswith("hada_") for k in parts):
        terms += [_product(parts, "hada_w1_a", "hada_w1_b"),
                  _product(parts, "hada_w2_a", "hada_w2_b")]
    if any(k.startswith("lokr_") for k in parts):
        (r1, c1), (r2, c2) = _factor(parts, "lokr_w1"), _factor(parts, "lokr_w2")
        terms.append((Axis(r1.size * r2.size, r1.tensors + r2.tensors),
                      Axis(c1.size * c2.size, c1.tensors + c2.tensors)))
    if "dora_scale" in parts:
        terms.append((Axis(parts["dora_scale"].numel(), ("dora_scale",)), None))
    return terms


def _factor(parts: dict[str, torch.Tensor], name: str) -> tuple[Axis, Axis]:
    """A LoKr factor's (rows, cols): whole (`name`) or the product `name_a @ name_b`."""
    if name in parts:
        tensor = parts[name]
        return Axis(tensor.shape[0], (name,)), Axis(tensor[0].numel(), (name,))
    return _product(parts, f"{name}_a", f"{name}_b")


def _product(parts: dict[str, torch.Tensor], a: str, b: str) -> tuple[Axis, Axis]:
    """The (rows, cols) of `a @ b` (b flattened past its first axis, as for a conv)."""
    if a not in parts or b not in parts:
        found = [name for name in (a, b) if name in parts]
        raise _Unfit(f"it has {found[0]} without {({a, b} - set(found)).pop()}" if found
                     else f"it lacks {a} and {b}")
    left, right = parts[a], parts[b]
    if left.ndim < 2 or right.ndim < 2 or left.shape[1] != right.shape[0]:
        raise _Unfit(f"{a} {tuple(left.shape)} and {b} {tuple(right.shape)} do not multiply "
                     "(their ranks differ)")
    return Axis(left.shape[0], (a,)), Axis(right[0].numel(), (b,))
