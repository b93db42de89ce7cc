"""`difftune lora verify FILE`: what each program would apply of a LoRA file, and each key
it would drop with the name it expects instead.

Rules per program and family come from `programs` (family data in keys.py). ComfyUI is
counted in keys (it reports each key it does not load), diffusers in the layers it adapts
(a fused original module, BFL's `qkv`, is three diffusers layers).
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from difftune.adapters.formats import load_lora_file
from difftune.lora_tools.detect import detect
from difftune.lora_tools.keys import DENOISER, TEXT, Module
from difftune.lora_tools.names import DIFFUSERS, ORIGINAL, FamilyNames, family_names
from difftune.lora_tools.programs import DIFFUSERS_FACTORS, Program, ReadRule, programs


@dataclass
class Dropped:
    """One key a program would not apply, the name it expects instead, and why."""

    key: str
    expected: str
    why: str


@dataclass
class ProgramResult:
    """What one program does with a file."""

    program: str
    applied: int
    unit: str
    dropped: list[Dropped] = field(default_factory=list)
    # modules whose fate the rules do not know: LyCORIS kinds in diffusers, whose LoKr
    # converters (Z-Image, FLUX.2) these rules do not follow
    unmodelled: list[str] = field(default_factory=list)


@dataclass
class Verification:
    """`verify`'s report: per program, and the text-encoder keys left unchecked."""

    path: str
    family: str
    results: list[ProgramResult]
    text_encoder_keys: int

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


# kohya's factor names as PEFT-style (dotted) spellings name them.
_PEFT_FACTORS = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}


def spell(prefix: str, name: str, tensor: str) -> str:
    """A key as `prefix` spells module `name` (underscores after a prefix ending in "_", and
    PEFT's factor names after a dotted one)."""
    if prefix.endswith("_"):
        return f"{prefix}{name.replace('.', '_')}.{tensor}"
    return f"{prefix}{name}.{_PEFT_FACTORS.get(tensor, tensor)}"


def _named(rule: ReadRule, module: Module, names: FamilyNames) -> tuple[tuple[str, ...], bool]:
    """(the names `rule` reads this module's update under, whether that is the module alone:
    not a part of a fused module, nor split into parts)."""
    if rule.naming in module.namings:
        return (module.name,), True
    found = names.translate(module.name, module.namings[0])
    found = tuple(n for n in found if not (rule.skips and re.fullmatch(rule.skips, n)))
    alone = len(found) == 1 and names.translate(found[0], rule.naming) == (module.name,)
    return found, alone


def expected(program: Program, module: Module, names: FamilyNames, tensor: str) -> str:
    """The key `program` reads for this module's tensor: by its first rule naming the module
    alone, else its first naming it at all ("part of ..." / "its parts ...": the update is
    fused with others' or split, which only a LoRA's factors allow)."""
    tensor = tensor if tensor in program.tensors else sorted(program.tensors)[0]
    named = [(rule, *_named(rule, module, names)) for rule in program.rules]
    for rule, found, alone in sorted(named, key=lambda r: not r[2]):
        if rule.skips and module.name in found and re.fullmatch(rule.skips, module.name):
            continue
        if found:
            keys = [spell(rule.prefix, n, tensor) for n in found]
            if alone:
                return keys[0]
            return ("part of " if len(keys) == 1 else "its parts ") + ", ".join(keys)
    return "none: no spelling of this module is read"


def _targets(module: Module, names: FamilyNames, naming: str) -> tuple[str, ...]:
    """The diffusers layers a module adapts."""
    return (module.name,) if naming == DIFFUSERS else names.translate(module.name, ORIGINAL)


def _rule(program: Program, module: Module) -> ReadRule | None:
    """The program's rule for the module's spelling, if it reads it."""
    return next((r for r in program.rules
                 if r.prefix == module.prefix and r.naming in module.namings), None)


def check_module(program: Program, module: Module, names: FamilyNames
                 ) -> tuple[int, list[Dropped]]:
    """(how much the program applies of one denoiser module, the keys it drops)."""
    def drop_all(why: str) -> tuple[int, list[Dropped]]:
        """Nothing applied: every tensor of the module dropped for `why`."""
        return 0, [Dropped(f"{module.key}.{t}", expected(program, module, names, t), why)
                   for t in sorted(module.tensors)]

    if program.absent:
        return drop_all(program.absent)
    rule = _rule(program, module)
    if rule is None:
        return drop_all(f"{program.name} does not read modules spelled "
                        f"{module.prefix or '(no prefix)'}<{module.namings[0]} name>")
    naming = rule.naming
    targets = _targets(module, names, naming)
    skipped = [t for t in targets if rule.skips and re.fullmatch(rule.skips, t)]
    if skipped and len(skipped) == len(targets):
        return drop_all(rule.why)
    tensors = set(module.tensors)
    unread = sorted(tensors - program.tensors)
    dropped = [Dropped(f"{module.key}.{t}", expected(program, module, names, t),
                       f"{program.name} reads no tensor named {t}") for t in unread]
    if program.counts == "keys":
        return len(tensors) - len(unread), dropped
    return len(targets) - len(skipped), dropped


def verify_modules(modules: list[Module], stray: list[str], family: str
                   ) -> list[ProgramResult]:
    """Every program's result over a file's resolved modules."""
    names, results = family_names(family), []
    for program in programs(family):
        result = ProgramResult(program.name, 0, program.counts)
        for module in modules:
            if module.part == DENOISER and program.counts == "modules" and not any(
                    set(pair) <= set(module.tensors) for pair in DIFFUSERS_FACTORS):
                result.unmodelled.append(module.key)
            elif module.part == DENOISER:
                applied, dropped = check_module(program, module, names)
                result.applied += applied
                result.dropped += dropped
            elif module.part != TEXT:
                result.dropped += [Dropped(f"{module.key}.{t}", "none",
                                           f"no module of {family} has this name")
                                   for t in sorted(module.tensors)]
        result.dropped += [Dropped(k, "none", "not a tensor name LoRA readers know")
                           for k in stray]
        results.append(result)
    return results


def verify_file(path: str | os.PathLike[str], family: str | None = None) -> Verification:
    """The verify report of the LoRA file at `path` (`family` forces the family)."""
    tensors, metadata = load_lora_file(path)
    name, _, modules, stray = detect(tensors, metadata, path, family)
    text = sum(len(m.tensors) for m in modules if m.part == TEXT)
    return Verification(str(Path(path)), name, verify_modules(modules, stray, name), text)
