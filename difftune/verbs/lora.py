"""`difftune lora ...`: the LoRA toolbox verbs as the CLI shows them (text or JSON).

The work is done by `difftune.lora_tools` (plain functions the web app calls too); this module
only renders their reports.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from difftune.errors import ConfigError
from difftune.lora_tools.convert import convert
from difftune.lora_tools.extract import extract
from difftune.lora_tools.inspect import Inspection, inspect_file
from difftune.lora_tools.merge_base import merge_into_base, parse_lora
from difftune.lora_tools.merge_loras import is_lora_file, merge_loras
from difftune.lora_tools.resize import Resized, resize_file
from difftune.lora_tools.verify import Dropped, Verification, verify_file


DROPS_FOUND = 3  # verify's exit status when a program would drop keys


def _listing(counts: dict[str, int]) -> str:
    """`a (3), b (1)`: counts by value, most first."""
    return ", ".join(f"{k} ({v})" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def inspect_text(report: Inspection) -> str:
    """The inspect report as lines of text."""
    lines = [f"file:      {report.path}",
             f"family:    {report.family}" + (f" (fits {', '.join(report.also_fits)} as well;"
                                              " pass --family to choose)"
                                              if report.also_fits else ""),
             f"kind:      {_listing(report.kinds)}",
             f"layout:    {_listing(report.layouts)}",
             f"trainer:   {report.trainer}" + (f" ({report.trainer_evidence})"
                                               if report.trainer_evidence else ""),
             f"ranks:     {_listing(report.ranks)}",
             f"alphas:    {_listing(report.alphas)}"]
    if report.strength:
        lines.append(f"strength:  mean {report.strength['mean']:.4g}, max "
                     f"{report.strength['max']:.4g} (|scale * up @ down|, Frobenius)")
    lines.append(f"modules:   {sum(report.blocks.values())} in the denoiser, "
                 f"{report.text_encoder_modules} in text encoders")
    lines += [f"  {block}: {count}" for block, count in report.blocks.items()]
    if len(report.ranks) > 1 or len(report.alphas) > 1:
        lines.append("per module (rank, alpha):")
        lines += [f"  {m.name}: {m.rank}, {m.alpha}" for m in report.modules]
    if report.unresolved:
        lines.append(f"not a module of {report.family}: {', '.join(report.unresolved[:8])}"
                     + (f" and {len(report.unresolved) - 8} more"
                        if len(report.unresolved) > 8 else ""))
    lines.append("non-finite: " + ("; ".join(f"{k}: {v}" for k, v in report.non_finite.items())
                                   or "none"))
    lines += ["metadata:"] + [f"  {k} = {v[:200]}" for k, v in report.metadata.items()]
    return "\n".join(lines)


def run_inspect(path: Path, family: str | None, as_json: bool) -> str:
    """`difftune lora inspect`: the report of one file, as text or JSON."""
    report = inspect_file(path, family)
    return json.dumps(report.as_json(), indent=2) if as_json else inspect_text(report)


def verify_text(report: Verification, limit: int = 20) -> str:
    """The verify report as lines of text: per program, what it applies and what it drops."""
    lines = [f"file:   {report.path}", f"family: {report.family}"]
    for result in report.results:
        verdict = "applies everything" if not result.dropped else \
            f"drops {len(result.dropped)} key(s)"
        lines.append(f"{result.program}: applies {result.applied} {result.unit}; {verdict}")
        lines += _dropped_lines(result.dropped, limit)
        if result.unmodelled:
            lines.append(f"  not known: {len(result.unmodelled)} LoHa/LoKr/full-diff module(s); "
                         "difftune's diffusers rules cover LoRA, LoCon and DoRA (diffusers "
                         "reads LoKr for some families through converters not followed here)")
    if report.text_encoder_keys:
        lines.append(f"text-encoder keys not checked: {report.text_encoder_keys}")
    return "\n".join(lines)


def _dropped_lines(dropped: list[Dropped], limit: int) -> list[str]:
    """The keys a program drops, at most `limit`; when all share one reason (ComfyUI has no
    model of the family, or reads none of the file's spelling), that reason once, with the
    first key as the example, instead of the same line per key."""
    if len(dropped) > 1 and len({d.why for d in dropped}) == 1:
        first = dropped[0]
        return [f"  dropped all {len(dropped)}: {first.why}; e.g. {first.key}, expected "
                f"{first.expected} (--json lists all)"]
    lines = [f"  dropped {d.key}: {d.why}; expected {d.expected}" for d in dropped[:limit]]
    if len(dropped) > limit:
        lines.append(f"  ... and {len(dropped) - limit} more (--json lists all)")
    return lines


def run_verify(path: Path, family: str | None, as_json: bool) -> tuple[str, int]:
    """`difftune lora verify`: the report, and exit status 0 when every program applies
    every key, DROPS_FOUND when one drops some (1 and 2 mean errors)."""
    report = verify_file(path, family)
    text = json.dumps(report.as_json(), indent=2) if as_json else verify_text(report)
    return text, DROPS_FOUND if any(r.dropped for r in report.results) else 0


def resize_text(report: Resized) -> str:
    """The resize report: each module's ranks and kept energy, then the file written."""
    lines = [f"  {name}: rank {old} -> {new}, kept {kept:.2%} of its update"
             for name, (old, new, kept) in report.modules.items()]
    least = min((k for _, _, k in report.modules.values()), default=1.0)
    return "\n".join(lines + [f"wrote {report.path} ({len(report.modules)} modules; least "
                               f"kept {least:.2%})"])


def run_resize(path: Path, rank: int | None, energy: float | None, out: Path | None,
               overwrite: bool, as_json: bool) -> str:
    """`difftune lora resize`: write the resized file, return the report."""
    report = resize_file(path, rank, energy, out, overwrite)
    return json.dumps(report.as_json(), indent=2) if as_json else resize_text(report)


def run_merge(base: Path, loras: list[str], out: Path | None, rank: int | None,
              family: str | None, overwrite: bool, as_json: bool) -> str:
    """`difftune lora merge`: into the base model file, or (BASE a LoRA) into one LoRA."""
    parsed = [parse_lora(text) for text in loras]
    if is_lora_file(base):
        report = merge_loras(base, parsed, out, rank, overwrite)
        text = f"wrote {report.path}: {report.changed} modules merged"
    else:
        if rank is not None:
            raise ConfigError("--rank applies to LoRA + LoRA merges; BASE is a model file")
        report = merge_into_base(base, parsed, out, family, overwrite)
        text = (f"wrote {report.path}: {report.changed} {report.family} tensors changed"
                + "".join(f"\n  not merged: {s}" for s in report.skipped))
    return json.dumps(report.as_json(), indent=2) if as_json else text


def run_extract(base: Path, tuned: Path, rank: int, out: Path | None, family: str | None,
                overwrite: bool, as_json: bool) -> str:
    """`difftune lora extract`: write the LoRA, report each module's kept energy."""
    report = extract(base, tuned, rank, out, family, overwrite)
    if as_json:
        return json.dumps(report.as_json(), indent=2)
    lines = [f"  {m}: kept {k:.2%} of its difference" for m, k in report.modules.items()]
    lines.append(f"wrote {report.path}: {len(report.modules)} {report.family} modules, keys "
                 f"spelled {report.spelling}")
    if report.not_carried:
        lines.append(f"not carried ({len(report.not_carried)}, a LoRA has no place for them): "
                     + ", ".join(report.not_carried[:6]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> tuple[str, int]:
    """`difftune lora <tool>` as parsed (verbs.lora_args): (text to print, exit status)."""
    if args.tool == "verify":
        return run_verify(args.file, args.family, args.json)
    if args.tool == "inspect":
        return run_inspect(args.file, args.family, args.json), 0
    if args.tool == "convert":
        report = convert(args.file, args.to, args.out, args.family, args.overwrite, args.base)
        text = (f"wrote {report.path}: {report.family}, {report.layout}; alpha "
                f"{report.alpha}" + (f"; {report.names_of}" if report.names_of else "")
                + "".join(f"\n  {k}: {v}" for k, v in report.applies.items()))
        return (json.dumps(report.as_json(), indent=2) if args.json else text), 0
    if args.tool == "resize":
        return run_resize(args.file, args.rank, args.energy, args.out, args.overwrite,
                          args.json), 0
    if args.tool == "merge":
        return run_merge(args.base, args.lora, args.out, args.rank, args.family,
                         args.overwrite, args.json), 0
    return run_extract(args.base, args.tuned, args.rank, args.out, args.family,
                       args.overwrite, args.json), 0
