"""`difftune lora convert FILE --to comfy|diffusers|kohya`: a LoRA file in another layout.

Read: each module is named in the family's diffusers naming (as found), or in its original
naming, which goes through the family's own reader (`Family.lora_from_format`, as kohya's
`lora_unet_` keys) to diffusers names. Written: "diffusers" as `<prefix>.<module>.lora_A/B`
with each module's scale (alpha / rank) folded into lora_B (scale 1, as every reader then
applies it); "kohya" through the family's writer (`Family.lora_to_format`) with the scale
folded and alpha = rank; "comfy" as the family's default layout, the one ComfyUI (and
diffusers) read in full. LoHa, LoKr, DoRA and full-diff modules go to "comfy" only, renamed to
the spelling ComfyUI reads; where a layout cannot carry a file, it is refused with the reason.
The family's readers take a model for its layout; they get the tiny flavor's, whose names
(not sizes) they use, except where a family's original names depend on the model's layout
(keys.py `RELEASED_LAYOUTS`) and the file is read or written in them: then the model is a
released one's that fits the file, or `--base`'s (`layouts`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from difftune.adapters.formats import load_lora_file, save_lora
from difftune.errors import CheckpointError, ConfigError
from difftune.families import registry
from difftune.families.base import Components
from difftune.lora_tools import kinds, layouts
from difftune.lora_tools.detect import detect
from difftune.lora_tools.factors import pair_of
from difftune.lora_tools.keys import DENOISER, Module
from difftune.lora_tools.names import DIFFUSERS, family_names, tiny_components
from difftune.lora_tools.output import out_path
from difftune.lora_tools.programs import comfyui, comfyui_loads_nothing
from difftune.lora_tools.verify import check_module, expected, verify_modules
from difftune.lora_tools.keys import read_modules

TARGETS = ("comfy", "diffusers", "kohya")


@dataclass
class Converted:
    """What `convert` wrote, how alpha was handled, and what each program applies of it."""

    path: str
    family: str
    layout: str
    alpha: str
    names_of: str = ""  # which model's layout original names were read/written in, if any
    applies: dict[str, str] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        """The report as plain JSON values."""
        return asdict(self)


@lru_cache(maxsize=None)
def _comps(family: str) -> Components:
    """The tiny flavor the family's readers and writers get (for names), built once."""
    return tiny_components(family)


def diffusers_state(modules: list[Module], family: str, label: str,
                    comps: Components | None = None) -> dict[str, torch.Tensor]:
    """Every LoRA module in diffusers names with its scale folded into lora_B; original
    names are read against `comps` (the tiny flavor when None)."""
    fam, kohya, state = registry.get(family), {}, {}
    for m in modules:
        pair = pair_of(m)
        if pair is None or kinds.kind(m.tensors) not in (kinds.LORA, kinds.LOCON):
            raise ConfigError(f"{label}: {m.key} is a {kinds.kind(m.tensors)}; only LoRA and "
                              "LoCon modules go into the diffusers and kohya layouts (their "
                              "PEFT and kohya names carry no other kind): use --to comfy")
        down, up = m.tensors[pair[0]], m.tensors[pair[1]]
        alpha = kinds.alpha(m.tensors, None) or float(down.shape[0])
        if DIFFUSERS in m.namings:
            stem = f"{fam.denoiser_prefix}.{m.name}"
            state[f"{stem}.lora_A.weight"] = down
            state[f"{stem}.lora_B.weight"] = up * (alpha / down.shape[0])
        else:
            stem = "lora_unet_" + m.name.replace(".", "_")
            kohya |= {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                      f"{stem}.alpha": torch.tensor(alpha)}
    if kohya:
        split, alphas = fam.lora_from_format(comps or _comps(family), kohya)
        for key, value in split.items():
            module = key.rpartition(".lora_")[0]
            rank = split[f"{module}.lora_A.weight"].shape[0]
            scale = alphas.get(module, float(rank)) / rank
            state[key] = value * scale if key.endswith("lora_B.weight") else value
    return state


def _lycoris_for_comfy(modules: list[Module], family: str, label: str
                       ) -> dict[str, torch.Tensor]:
    """LyCORIS-kind modules in a spelling ComfyUI reads: as they are where it reads them,
    else renamed to its name for the same module alone."""
    program, names, out = comfyui(family), family_names(family), {}
    for m in modules:
        if not check_module(program, m, names)[1]:
            out |= {f"{m.key}.{t}": v for t, v in m.tensors.items()}
            continue
        for tensor, value in m.tensors.items():
            key = expected(program, m, names, tensor)
            if " " in key:
                raise ConfigError(f"{label}: {m.key} ({kinds.kind(m.tensors)}) is part of a "
                                  f"fused module in ComfyUI's names ({key}); a "
                                  f"{kinds.kind(m.tensors)} cannot be split or fused")
            out[key] = value
    return out


def _write_layout(state: dict[str, torch.Tensor], family: str, fmt: str, label: str,
                  comps: Components | None = None) -> dict[str, torch.Tensor]:
    """A scale-1 diffusers state in the family's layout `fmt`, named against `comps` (the
    tiny flavor when None)."""
    if fmt == "diffusers":
        return state
    if fmt not in registry.spec(family).formats:
        absent = comfyui_loads_nothing(family)
        readers = "diffusers reads" if absent else "ComfyUI and diffusers read"
        raise ConfigError(f"{label}: {family} LoRAs have no {fmt} layout ({readers} its "
                          f"{registry.spec(family).default_format} layout: --to comfy"
                          + (f"; {absent})" if absent else ")"))
    ranks = sorted({int(v.shape[0]) for k, v in state.items() if k.endswith("lora_A.weight")})
    if len(ranks) > 1:
        raise ConfigError(f"{label}: its modules have ranks {ranks}; the {fmt} layout fuses "
                          "modules of one rank: `difftune lora resize --rank R` first")
    fam = registry.get(family)
    return fam.lora_to_format(comps or _comps(family), state, fmt, ranks[0], float(ranks[0]))


def _layout_free(modules: list[Module], family: str, fmt: str, label: str
                 ) -> dict[str, torch.Tensor] | None:
    """The file in `fmt` where no name read or written depends on the model's layout (all in
    diffusers names, as SD 1.5's kohya layout is), else None."""
    if any(DIFFUSERS not in m.namings for m in modules):
        return None
    state = diffusers_state(modules, family, label)
    try:
        written = _write_layout(state, family, fmt, label)
    except CheckpointError:  # the tiny flavor lacks a module of the file's model
        return None
    out, _ = read_modules(written, family_names(family))
    return written if all(DIFFUSERS in m.namings for m in out) else None


def _converted(modules: list[Module], family: str, fmt: str, label: str, base: Path | None
               ) -> tuple[dict[str, torch.Tensor], str]:
    """The LoRA modules in layout `fmt`, read and written against the model they fit
    (`layouts`: the tiny flavor's names, a released model's, or --base's), and which model
    that was ("" where no name depends on it)."""
    if not layouts.released(family):
        state = diffusers_state(modules, family, label)
        unused = f"--base ignored: {family}'s names do not depend on the model" if base else ""
        return _write_layout(state, family, fmt, label), unused
    if base is None:
        free = _layout_free(modules, family, fmt, label)
        if free is not None:
            return free, ""
    misfits = []
    for where, comps in layouts.candidates(family, base):
        try:
            state = diffusers_state(modules, family, label, comps)
        except CheckpointError as err:
            misfits.append(f"{where}: {err}")
            continue
        wrong = layouts.misfit(state, comps, registry.get(family).denoiser_prefix)
        if wrong is None:
            return _write_layout(state, family, fmt, label, comps), f"original names in the layout of {where}"
        misfits.append(f"{where}: {wrong}")
    raise ConfigError(f"{label}: its {family} original names depend on the model's layout, "
                      f"and the model it was made for is not "
                      f"{'that' if base else 'a released one'} ({'; '.join(misfits)}); pass "
                      "--base MODEL, the diffusers folder or single file of the model it was "
                      "trained on")


def convert(path: Path, to: str, out: Path | None = None, family: str | None = None,
            overwrite: bool = False, base: Path | None = None) -> Converted:
    """Write FILE in layout `to` (see the module's doc) and say what each program applies;
    `base` is the model folder whose layout original names are read against."""
    if to not in TARGETS:
        raise ConfigError(f"--to {to!r}: choose one of {', '.join(TARGETS)}")
    target = out_path(path, out, to, overwrite)
    tensors, metadata = load_lora_file(path)
    name, _, modules, _ = detect(tensors, metadata, path, family)
    denoiser = [m for m in modules if m.part == DENOISER]
    skipped = len(modules) - len(denoiser)
    lycoris = any(kinds.kind(m.tensors) not in (kinds.LORA, kinds.LOCON) for m in denoiser)
    fmt = registry.spec(name).default_format if to == "comfy" else to
    if lycoris and to == "comfy":
        written, alpha = _lycoris_for_comfy(denoiser, name, str(path)), "kept as written"
        model = "--base ignored: LyCORIS kinds keep their names" if base else ""
        fmt = "ComfyUI's LyCORIS names"
    else:
        written, model = _converted(denoiser, name, fmt, str(path), base)
        alpha = "folded into the up factors (scale 1; alpha = rank where the layout has it)"
    keep = {k: v for k, v in metadata.items() if k.startswith(("ss_", "modelspec."))}
    keep["difftune.converted"] = f"{path.name} -> {fmt}"
    save_lora(target, written, keep)
    report = Converted(str(target), name, fmt, alpha, model)
    for result in verify_modules(*read_modules(written, family_names(name)), name):
        report.applies[result.program] = (f"{result.applied} {result.unit}, drops "
                                          f"{len(result.dropped)} key(s)")
    if skipped:
        report.applies["not converted"] = f"{skipped} text-encoder or unknown module(s)"
    return report
