"""The module names a family's LoRA files may carry, in both namings readers use.

Every family declares two namings through code it already has: its diffusers denoiser's module
names and its single-file layout (`Family.single_file_layout`: the original names ComfyUI and
Forge load, each with the diffusers tensors it is made of). Both are read from the family's
tiny flavor (real classes, tiny configs: built in a fraction of a second, no weights read), of
every variant, with every whole-number segment of a name (a block index) standing for any
number, so a name of the full-size model of the family matches too.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from types import ModuleType

import torch

from difftune.families import registry
from difftune.families.base import Components

DIFFUSERS, ORIGINAL = "diffusers", "original"
_SINGLE_FILE_ROOT = "model.diffusion_model."  # SGM-style single files put it before each name


def generalize(name: str, sep: str) -> str:
    """`name` with each `sep`-separated segment made of digits written as `#`."""
    return sep.join("#" if part.isdigit() else part for part in name.split(sep))


@dataclass(frozen=True)
class Naming:
    """One naming of a family's modules: {generalized dotted name: template}, and the
    underscored forms ({fully generalized underscored name: [(regex, dotted template)]})."""

    dotted: dict[str, str]
    underscored: dict[str, list[tuple[re.Pattern[str], str]]]

    def resolve(self, module: str, underscored: bool) -> str | None:
        """The dotted module name `module` is (as written, dots or underscores), or None."""
        if not underscored:
            return module if generalize(module, ".") in self.dotted else None
        for pattern, template in self.underscored.get(generalize(module, "_"), []):
            found = pattern.fullmatch(module)
            if found:
                numbers = iter(found.groups())
                return ".".join(next(numbers) if p == "#" else p for p in template.split("."))
        return None


def _naming(names: set[str]) -> Naming:
    """The lookup tables of a set of dotted module names."""
    dotted = {generalize(n, "."): generalize(n, ".") for n in names}
    under: dict[str, list[tuple[re.Pattern[str], str]]] = {}
    for template in dotted:
        flat = template.replace(".", "_")
        regex = re.compile("_".join(r"(\d+)" if p == "#" else re.escape(p)
                                    for p in template.split(".")))
        under.setdefault(generalize(flat, "_"), []).append((regex, template))
    return Naming(dotted, under)


def _digits(name: str) -> list[tuple[int, str]]:
    """(position, value) of each whole-number segment of a dotted name."""
    return [(i, p) for i, p in enumerate(name.split(".")) if p.isdigit()]


def _renumber(name: str, model: str, wanted: str) -> str:
    """`name` (a module of the tiny model, related to its module `model`) with the block
    indices `wanted` has where `model` has others: an index after a segment both names share
    (`transformer_blocks.N`) is carried over there, the first index otherwise to `name`'s
    first index (`double_blocks.N` <-> `transformer_blocks.N`)."""
    parts, mparts = name.split("."), model.split(".")
    mine = _digits(name)
    for (i, old), (_, new) in zip(_digits(model), _digits(wanted)):
        if old == new:
            continue
        before = mparts[i - 1] if i else ""
        spot = next((j for j, _ in mine if j and parts[j - 1] == before), None)
        if spot is None and mine and i == _digits(model)[0][0]:
            spot = mine[0][0]
        if spot is not None:
            parts[spot] = new
    return ".".join(parts)


def _closest(name: str, exact: dict[str, list[str]]) -> str | None:
    """The tiny model's module of `name`'s general form agreeing with it in most indices."""
    candidates = exact.get(generalize(name, "."), [])
    if not candidates:
        return None
    digits = [v for _, v in _digits(name)]
    return max(candidates, key=lambda c: sum(a == b for a, b in
                                                 zip((v for _, v in _digits(c)), digits)))


@dataclass(frozen=True)
class FamilyNames:
    """A family's module names: diffusers', original (single-file) ones, and which diffusers
    modules each original one is made of (`pieces`, the tiny model's exact names, in the
    order they are stacked along the output rows), their rows in the tiny model (`rows`:
    fused parts keep their proportions at any width), and the original modules whose two
    output halves are the diffusers module's swapped (`swapped`, BFL's final modulation)."""

    family: str
    diffusers: Naming
    original: Naming
    pieces: dict[str, tuple[str, ...]]
    rows: dict[str, tuple[int, ...]]
    swapped: frozenset[str]

    @cached_property
    def _tables(self) -> dict[str, tuple[dict[str, tuple[str, ...]], dict[str, list[str]]]]:
        """Per naming translated from: {module: other naming's modules} and its modules by
        general form; built once (`lora verify` translates every module under every rule)."""
        out = {}
        for naming, table in ((ORIGINAL, self.pieces), (DIFFUSERS, _inverse(self.pieces))):
            exact: dict[str, list[str]] = {}
            for key in table:
                exact.setdefault(generalize(key, "."), []).append(key)
            out[naming] = (table, exact)
        return out

    def closest_piece(self, module: str) -> str | None:
        """The tiny model's original module of `module`'s general form, most alike in indices."""
        return _closest(module, self._tables[ORIGINAL][1])

    def naming(self, which: str) -> Naming:
        """DIFFUSERS or ORIGINAL."""
        return self.diffusers if which == DIFFUSERS else self.original

    def translate(self, module: str, naming: str) -> tuple[str, ...]:
        """The modules of the other naming that `module` (of `naming`) is, or is a part of
        (an original fused `qkv` is three diffusers modules; a diffusers `to_q` is part of
        one original module); () where the other naming has none."""
        table, exact = self._tables[ORIGINAL if naming == ORIGINAL else DIFFUSERS]
        model = _closest(module, exact)
        if model is None:
            return ()
        return tuple(_renumber(n, model, module) for n in table[model])


def _inverse(pieces: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """{diffusers module: (the original modules made from it,)}."""
    out: dict[str, list[str]] = {}
    for original, sources in pieces.items():
        for source in sources:
            out.setdefault(source, []).append(original)
    return {k: tuple(v) for k, v in out.items()}


def family_keys(name: str) -> ModuleType:
    """Family `name`'s keys.py module (its LoRA names and the readers' rules)."""
    package = registry.FAMILIES[name][0].rsplit(".", 1)[0]
    return importlib.import_module(f"{package}.keys")


def tiny_components(name: str, variant: str | None = None) -> Components:
    """Family `name`'s tiny flavor (of `variant`) on the CPU, in the default precision."""
    from difftune.config import ModelConfig, PrecisionConfig
    from difftune.precision.policy import PrecisionPolicy

    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    model = ModelConfig(family=name, flavor="tiny", variant=variant)
    return registry.get(name, variant).load(model, policy)


@lru_cache(maxsize=None)
def family_names(name: str) -> FamilyNames:
    """The module names of family `name` (every variant's tiny flavor), built once a process."""
    diffusers: set[str] = set()
    original: set[str] = set()
    pieces: dict[str, tuple[str, ...]] = {}
    rows: dict[str, tuple[int, ...]] = {}
    swapped: set[str] = set()
    for variant, _ in registry.variant_specs(name):
        family = registry.get(name, variant)
        comps = tiny_components(name, variant)
        denoiser = comps.denoiser
        diffusers |= {n for n, m in denoiser.named_modules()
                      if n and isinstance(getattr(m, "weight", None), torch.Tensor)}
        state = denoiser.state_dict()
        for key, piece in (family.single_file_layout(comps) or {}).items():
            module = key.removeprefix(_SINGLE_FILE_ROOT).removesuffix(".weight")
            if key.endswith(".weight") and module not in pieces:
                original.add(module)
                pieces[module] = tuple(s.removesuffix(".weight") for s in piece.sources)
                rows[module] = tuple(int(state[s].shape[0]) for s in piece.sources)
                if piece.swap:
                    swapped.add(module)
    return FamilyNames(name, _naming(diffusers), _naming(original), pieces, rows,
                       frozenset(swapped))
