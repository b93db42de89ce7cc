"""`difftune lora merge BASE --lora A[:w] ... --out OUT`: LoRAs merged into a base model file.

The base is a safetensors file of the family's denoiser, in its single-file (original) names
or in diffusers' names, under any root (`model.diffusion_model.`, `diffusion_model.`, none).
Each LoRA module is placed on the base tensor(s) it changes: the same name, or, across
namings, the rows of a fused tensor it is part of (BFL's `qkv` holds to_q, to_k, to_v: each
part's rows are in the proportions the family's layout stacks them, read from its tiny model),
with halves swapped where the layout swaps them. The output is written tensor by tensor
(`files.single.write_streamed`) in the base's dtypes, each base tensor read, changed and
written alone, so host memory stays near one tensor beyond the LoRAs' factors.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from difftune.adapters.across import lacking, lora_source
from difftune.adapters.formats import load_lora_file
from difftune.errors import ConfigError
from difftune.families import registry
from difftune.lora_tools import kinds
from difftune.lora_tools.detect import detect
from difftune.lora_tools.factors import Update, factors
from difftune.lora_tools.keys import DENOISER, Module
from difftune.lora_tools.names import DIFFUSERS, ORIGINAL, FamilyNames, family_names
from difftune.lora_tools.output import model_file, out_path
from difftune.files.single import write_streamed

ROOTS = ("model.diffusion_model.", "diffusion_model.", "transformer.", "unet.", "")
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
                 "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


@dataclass
class Merged:
    """What `merge` did: the file written, the base tensors changed, LoRA modules skipped."""

    path: str
    family: str
    changed: int
    skipped: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


def base_naming(keys: list[str], names: FamilyNames) -> tuple[str, str]:
    """(root, naming) of a base file's weight names: the pair that names most of them."""
    weights = [k.removesuffix(".weight") for k in keys if k.endswith(".weight")]
    scores = {(root, naming): sum(1 for w in weights if w.startswith(root) and
                                  names.naming(naming).resolve(w[len(root):], False))
              for root in ROOTS for naming in (ORIGINAL, DIFFUSERS)}
    best = max(scores, key=lambda k: scores[k])
    if not scores[best]:
        raise ConfigError(f"the base file's tensors are not {names.family} denoiser weights "
                          "in its single-file or diffusers names; pass the denoiser's file")
    return best


def placements(module: Module, part: Update, root: str, naming: str, names: FamilyNames,
               shapes: dict[str, list[int]]) -> list[tuple[str, int, Update]]:
    """(base key, first row, the factors of those rows) for one LoRA module."""
    if naming in module.namings:
        return [(f"{root}{module.name}.weight", 0, part)]
    if naming == ORIGINAL:  # a diffusers module: its rows inside a fused original tensor
        out = []
        for original in names.translate(module.name, DIFFUSERS):
            model = names.closest_piece(original)
            parts = names.translate(original, ORIGINAL)
            key = f"{root}{original}.weight"
            if model is None or key not in shapes or module.name not in parts:
                continue
            tiny = names.rows[model]
            share = shapes[key][0] / sum(tiny)
            index = parts.index(module.name)
            start = round(sum(tiny[:index]) * share)
            swap = original in names.swapped
            out.append((key, start, part.swapped() if swap else part))
        return out
    whole = part.swapped() if module.name in names.swapped else part
    out, start = [], 0
    for piece in names.translate(module.name, ORIGINAL):  # an original module: split rows
        rows = shapes.get(f"{root}{piece}.weight", [0])[0]
        out.append((f"{root}{piece}.weight", 0, whole.rows(start, start + rows)))
        start += rows
    return out


def parse_lora(text: str) -> tuple[Path, float]:
    """`PATH[:WEIGHT]` -> (path, weight); a bad weight is refused naming the argument."""
    path, sep, weight = text.rpartition(":")
    if not sep or not path or "/" in weight or "\\" in weight:
        return Path(text), 1.0
    try:
        return Path(path), float(weight)
    except ValueError:
        raise ConfigError(f"--lora {text}: the weight after ':' must be a number, e.g. "
                          f"{path}:0.8") from None


def _plan(loras: list[tuple[Path, float]], root: str, naming: str, names: FamilyNames,
          shapes: dict[str, list[int]], report: Merged) -> dict[str, list[tuple[int, Update]]]:
    """{base key: [(first row, factors)]} of every LoRA's modules."""
    plan: dict[str, list[tuple[int, Update]]] = {}
    for path, weight in loras:
        tensors, metadata = load_lora_file(path)
        source = lora_source("--lora", path, metadata, registry.spec(report.family))
        _, _, modules, _ = detect(tensors, metadata, path, report.family)
        for module in modules:
            why = lacking(source, module.key) or (
                None if module.part == DENOISER else "not the denoiser's")
            if why is not None:
                report.skipped.append(f"{path.name}: {module.key} ({why})")
                continue
            part = factors(module, weight, kinds.file_alpha(metadata), str(path))
            placed = [p for p in placements(module, part, root, naming, names, shapes)
                      if p[0] in shapes]
            if not placed:
                raise ConfigError(f"{path}: {module.key} has no tensor in the base file; it "
                                  "is for another model (another family's: pass --family "
                                  "NAME), or pass the denoiser's own file")
            for key, start, rows in placed:
                plan.setdefault(key, []).append((start, rows))
    return plan


def merge_into_base(base: Path, loras: list[tuple[Path, float]], out: Path | None = None,
                    family: str | None = None, overwrite: bool = False) -> Merged:
    """Write BASE with every LoRA merged at its weight (see the module's doc)."""
    target = out_path(model_file(base, "BASE"), out, "merged", overwrite)
    first, _ = load_lora_file(loras[0][0])
    name = family or detect(first, {}, loras[0][0])[0]
    del first
    names = family_names(name)
    with safe_open(str(base), framework="pt", device="cpu") as f:
        keys, metadata = list(f.keys()), dict(f.metadata() or {})
        shapes = {k: list(f.get_slice(k).get_shape()) for k in keys}
        dtypes = {k: _TORCH_DTYPES[f.get_slice(k).get_dtype()] for k in keys}
        root, naming = base_naming(keys, names)
        report = Merged(str(target), name, 0)
        plan = _plan(loras, root, naming, names, shapes, report)

        def produce(key: str) -> torch.Tensor:
            """One base tensor with its planned updates added (in float32, cast back by
            the writer to the base's dtype)."""
            tensor = f.get_tensor(key)
            if key not in plan:
                return tensor
            merged = tensor.float()
            for start, part in plan[key]:
                rows = part.out_rows
                merged[start:start + rows] += part.delta((rows, *shapes[key][1:]))
            report.changed += 1
            return merged

        metadata["difftune.merged"] = json.dumps([[p.name, w] for p, w in loras])
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            write_streamed(tmp, [(k, dtypes[k], shapes[k]) for k in keys], produce, metadata)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return report
