"""Which trained modules a LoRA file's readers (ComfyUI, diffusers) would not apply, per layout.

A family declares, as data in its spec (`lora_unread`), the modules a reader drops or
misapplies in each of its layouts ("diffusers", "kohya", "original", or "lycoris" for the
LyCORIS-kind files), with the reason, as read from that reader's source. `difftune check` and
the start of training say so, naming the modules, and name a layout that carries them all
where one exists: a reader that silently loses trained layers is the failure this prevents.
"""

from __future__ import annotations

import re

from difftune.families.base import Family

LYCORIS = "lycoris"  # the layout name of LoCon/LoHa/LoKr/DoRA files in `lora_unread`


def unread(family: Family, fmt: str, modules: list[str]) -> dict[str, tuple[list[str], str]]:
    """{reader: (the modules of `modules` it would not apply from a `fmt` file, why)}."""
    out: dict[str, tuple[list[str], str]] = {}
    for layout, reader, pattern, why in family.lora_unread:
        hit = sorted(m for m in modules if layout == fmt and re.fullmatch(pattern, m))
        if hit:
            names, whys = out.get(reader, ([], ""))
            out[reader] = (sorted({*names, *hit}), f"{whys}; {why}" if whys else why)
    return out


def describe(family: Family, fmt: str, modules: list[str]) -> str:
    """"" when every reader applies every module of a `fmt` file; else a sentence naming, per
    reader, the modules it would not apply and why, and a plain-LoRA layout that carries all of
    them to every reader (or that none does)."""
    missed = unread(family, fmt, modules)
    if not missed:
        return ""
    parts = [f"{reader} would not apply {_names(names)} as trained ({why})"
             for reader, (names, why) in sorted(missed.items())]
    if fmt == LYCORIS:
        return "; ".join(parts)
    full = [f for f in family.formats if not unread(family, f, modules)]
    hint = (f'save.format = "{full[0]}" carries every trained module to both readers'
            if full else "no layout carries every trained module to both readers; leave "
            "these modules out of adapter.target_modules to train only what both apply")
    return "; ".join(parts) + "; " + hint


def _names(names: list[str]) -> str:
    """At most four module names, then a count."""
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return ", ".join(names[:4]) + more
