"""The LyCORIS file layout of LoCon, LoHa, LoKr and DoRA adapters: what ComfyUI and the
LyCORIS library read.

Each adapted module is stored under `<prefix>_<module name, dots as underscores>`: the
denoiser's prefix is the family's `lycoris_prefix` ("lycoris" for the diffusers-layout
families, which ComfyUI maps and LyCORIS's `create_lycoris_from_weights` reads; "lora_unet"
for SDXL, kohya's prefix over diffusers module names, which ComfyUI and LyCORIS's kohya network
read), a text encoder's is `lora_te<N>` (N counting the family's encoders from 1, as ComfyUI
maps CLIP-L, CLIP-G and T5) over the `text_model.` names every reader maps. A family renames
the denoiser modules ComfyUI maps only by another name (`lycoris_renames`: FLUX.2's shared
modulation layers under their BFL names, `lora_unet_double_stream_modulation_img_lin`); they
are read back under the standard names (`standard_names`).

Tensors per module, in LyCORIS's names: `lora_down.weight`/`lora_up.weight` (LoRA, LoCon),
`hada_w1_a`..`hada_w2_b` (LoHa), `lokr_w1` or `lokr_w1_a/_b`, `lokr_w2` or `lokr_w2_a/_b`
(LoKr), `dora_scale` (DoRA's magnitude, on the output axis: shape (out, 1, ...), float32
whatever save.dtype), and `alpha`.

Scales: readers take alpha / dim, dim being the rank of the file's low-rank factor
(`lora_down`'s rows, `hada_w1_b`'s, LoKr's `w1_b` or else `w2_b`), and 1 for a LoKr with
both factors whole (alpha is then ignored). peft scales by alpha / r always, so the file's
alpha is written as peft's scale times dim, and a whole-factor LoKr gets the scale folded
into `lokr_w1`: the file means exactly the update that was trained.
"""

from __future__ import annotations

import re

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from difftune.adapters.formats import with_clip_root
from difftune.errors import CheckpointError
from difftune.families.base import Family

ADAPTER = "default"  # peft's adapter name in every difftune model
# peft attribute -> the LyCORIS file's tensor name (others keep their names).
FILE_NAMES = {"lora_A": "lora_down.weight", "lora_B": "lora_up.weight",
              "lora_magnitude_vector": "dora_scale"}
# The factor that carries a rescaled strength (the update is linear in it).
_SCALED = ("lora_B", "hada_w1_a", "lokr_w1", "lokr_w1_a")
_RANKED = ("lora_A", "hada_w1_b", "lokr_w1_b", "lokr_w2_b")  # rows = the file's dim
# Written in float32 whatever save.dtype: a DoRA magnitude is about its row's norm, so bf16's
# rounding (1 part in 512) is as large as what training changes in it (10-15% of each layer's
# trained change, measured on tiny FLUX.1 and Z-Image runs); the vectors are small.
FULL_PRECISION = (".dora_scale",)


def prefixes(family: Family) -> dict[str, str]:
    """{component prefix ("unet", "text_encoder_2"): the file's name prefix}."""
    out = {family.denoiser_prefix: family.lycoris_prefix}
    encoders = family.text_encoder_prefixes.values()
    out |= {prefix: f"lora_te{i}" for i, prefix in enumerate(encoders, 1)}
    return out


def adapted_layers(family: Family, modules: dict[str, torch.nn.Module], roots: dict[str, str]
                   ) -> dict[str, BaseTunerLayer]:
    """{file module name: the peft layer} of every adapted layer of `modules` (by prefix).

    `roots` is the file's CLIP naming (`families.common.text.file_clip_roots`)."""
    names = prefixes(family)
    out: dict[str, BaseTunerLayer] = {}
    for prefix, model in modules.items():
        for name, layer in model.named_modules():
            if isinstance(layer, BaseTunerLayer) and ADAPTER in _factors(layer):
                key = next(iter(with_clip_root({f"{prefix}.{name}": 0}, roots)))
                module = key.partition(".")[2]
                renamed = (rename(module, family.lycoris_renames)
                           if prefix == family.denoiser_prefix else None)
                out[renamed or f"{names[prefix]}_{module.replace('.', '_')}"] = layer
    return out


def standard_names(family: Family, tensors: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """A file's tensors with the family's renamed denoiser modules (`lycoris_renames`) back
    under `<lycoris_prefix>_<module>`, the names LyCORIS's wrapper looks modules up by."""
    back = tuple((new, f"{family.lycoris_prefix}_{module.replace('.', '_')}")
                 for module, new in family.lycoris_renames)
    out = {}
    for key, value in tensors.items():
        module, dot, suffix = key.partition(".")
        out[f"{rename(module, back) or module}{dot}{suffix}"] = value
    return out


def rename(name: str, pairs: tuple[tuple[str, str], ...]) -> str | None:
    """`name` renamed by the first pair (old, new) whose `old` it is, or None: `{n}` in a pair
    stands for any block index, the same in `new` (the file names each block's modules)."""
    for old, new in pairs:
        if "{n}" not in old:
            if name == old:
                return new
            continue
        found = re.fullmatch(r"(\d+)".join(re.escape(p) for p in old.split("{n}")), name)
        if found:
            return new.replace("{n}", found[1])
    return None


def _factors(layer: BaseTunerLayer) -> dict[str, dict[str, torch.Tensor]]:
    """{adapter name: {peft factor name: its tensor}} of one peft layer."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for attr in (*layer.adapter_layer_names, "lora_magnitude_vector"):
        container = getattr(layer, attr, None)
        if not isinstance(container, (torch.nn.ModuleDict, torch.nn.ParameterDict)):
            continue
        for adapter, value in container.items():
            tensor = value.weight if isinstance(value, torch.nn.Module) else value
            found.setdefault(adapter, {})[attr] = tensor
    return found


def _dim(factors: dict[str, torch.Tensor]) -> int | None:
    """The rank readers divide alpha by (None: a LoKr with both factors whole)."""
    for name in _RANKED:
        if name in factors:
            return int(factors[name].shape[0])
    return None


def layer_tensors(layer: BaseTunerLayer) -> dict[str, torch.Tensor]:
    """One peft layer's adapter as LyCORIS file tensors (suffix -> tensor), same update."""
    factors = {k: v.detach() for k, v in _factors(layer)[ADAPTER].items()}
    scale = float(layer.scaling[ADAPTER])
    dim = _dim(factors)
    if dim is None:  # whole LoKr: readers scale by 1
        factors["lokr_w1"] = factors["lokr_w1"] * scale
    out = {FILE_NAMES.get(k, k): v for k, v in factors.items()}
    if "dora_scale" in out:
        weight = layer.get_base_layer().weight
        out["dora_scale"] = out["dora_scale"].reshape(weight.shape[0], *[1] * (weight.ndim - 1))
    out["alpha"] = torch.tensor(scale * dim if dim is not None else 1.0, dtype=torch.float32)
    return out


def to_file(layers: dict[str, BaseTunerLayer]) -> dict[str, torch.Tensor]:
    """Every adapted layer's file tensors, keyed `<file module>.<suffix>`."""
    return {f"{name}.{suffix}": t for name, layer in layers.items()
            for suffix, t in layer_tensors(layer).items()}


def file_kind(tensors: dict[str, torch.Tensor]) -> str:
    """What a LyCORIS-layout file holds: "loha", "lokr", "dora" or "lora" (LoRA/LoCon)."""
    suffixes = {k.partition(".")[2] for k in tensors}
    if any(s.startswith("hada_") for s in suffixes):
        return "loha"
    if any(s.startswith("lokr_") for s in suffixes):
        return "lokr"
    return "dora" if "dora_scale" in suffixes else "lora"


def load_into(path: object, layers: dict[str, BaseTunerLayer],
              tensors: dict[str, torch.Tensor]) -> list[str]:
    """Copy a LyCORIS file's modules into the run's peft layers, each with the update the
    file means (its alpha / dim rescaled to this run's scale); returns the modules the file
    lacks. A module or factor this run does not have is an error naming the fix."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        module, _, suffix = key.partition(".")
        grouped.setdefault(module, {})[suffix] = value
    unknown = sorted(m for m in grouped if m not in layers)
    if unknown:
        raise CheckpointError(f"--init-lora {path} has modules this run does not train "
                              f"({', '.join(unknown[:4])}{', ...' if len(unknown) > 4 else ''})"
                              "; set adapter.targets / target_modules / text_encoders (or "
                              "adapter.conv_rank) to cover them")
    with torch.no_grad():
        for module, parts in grouped.items():
            _load_layer(path, module, layers[module], parts)
    return sorted(set(layers) - set(grouped))


def _load_layer(path: object, module: str, layer: BaseTunerLayer,
                parts: dict[str, torch.Tensor]) -> None:
    """One module's file tensors into its peft factors (shapes and factor sets must match)."""
    factors = _factors(layer)[ADAPTER]
    names = {FILE_NAMES.get(k, k): k for k in factors}
    given = set(parts) - {"alpha"}
    if given != set(names):
        raise CheckpointError(
            f"--init-lora {path}: {module} holds {sorted(given)}, this run's layer "
            f"{sorted(names)}; set adapter.rank / factor / decompose_both / full_matrix / "
            "dora as the file was trained")
    dim = _dim({names[k]: v for k, v in parts.items() if k in names})
    alpha = float(parts["alpha"]) if "alpha" in parts and dim is not None else None
    file_scale = alpha / dim if alpha is not None and dim is not None else 1.0
    ratio = file_scale / float(layer.scaling[ADAPTER])
    for suffix, peft_name in names.items():
        target, value = factors[peft_name], parts[suffix].float()
        if value.numel() != target.numel() or (suffix != "dora_scale"
                                               and value.shape != target.shape):
            raise CheckpointError(f"--init-lora {path}: {module}.{suffix} has shape "
                                  f"{tuple(value.shape)}, this run {tuple(target.shape)}; set "
                                  "adapter.rank (and the LoKr factor) to the file's")
        scaled = value * ratio if peft_name in _SCALED else value
        target.copy_(scaled.reshape(target.shape))


def needs_lycoris(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether a file is one diffusers' loaders cannot read (LoHa, LoKr, DoRA, or LyCORIS's
    `lycoris_` names), so `apply_file` applies it through the LyCORIS library. (A LoCon file
    whose modules are all renamed ones, `lycoris_renames`, reads as kohya's: a kohya file's
    names are the same.)"""
    return file_kind(tensors) != "lora" or any(k.startswith("lycoris_") for k in tensors)


def apply_file(family: Family, modules: dict[str, torch.nn.Module], roots: dict[str, str],
               tensors: dict[str, torch.Tensor], weight: float) -> list[torch.nn.Module]:
    """Apply a LyCORIS-layout file to live modules ({component prefix: module}) at `weight`
    through the LyCORIS library's own modules (`create_lycoris_from_weights`, `apply_to`);
    returns the networks (keep them alive while sampling). `roots` are the live CLIP roots
    (`model_clip_roots`): files name CLIP modules under `text_model.`."""
    from lycoris.wrapper import create_lycoris_from_weights  # only for sampling such files

    names, networks = prefixes(family), []
    tensors = standard_names(family, tensors)
    for prefix, module in modules.items():
        head = f"{names[prefix]}_"
        strip = "text_model_" if roots.get(prefix, None) == "" else ""
        mine = {"lycoris_" + k.removeprefix(head).removeprefix(strip): v
                for k, v in tensors.items() if k.startswith(head)}
        if not mine:
            continue
        param = next(module.parameters())
        net, _ = create_lycoris_from_weights(weight, "", module, weights_sd=mine)
        net.to(param.device)
        net.apply_to()
        networks.append(net)
    return networks
