"""The arguments of `difftune lora inspect|verify|resize|merge|extract`."""

from __future__ import annotations

import argparse
from pathlib import Path

from difftune.families.registry import names


def _common(p: argparse.ArgumentParser, out_default: str | None, family: bool = True) -> None:
    """--out/--overwrite (for verbs that write), --family and --json."""
    if out_default is not None:
        p.add_argument("--out", type=Path, help=f"the file to write (default: {out_default})")
        p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    if family:
        p.add_argument("--family", choices=names(), help="the model family, where the names "
                       "fit several")
    p.add_argument("--json", action="store_true", help="print JSON")


def add_lora_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register `difftune lora` and its tools on the CLI's verbs."""
    text = "inspect, verify, convert, resize, merge and extract LoRA files of any trainer"
    tools = verbs.add_parser("lora", help=text, description=text).add_subparsers(
        dest="tool", required=True)
    for name, help_text in (("inspect", "family, kind, layout, trainer, ranks, metadata"),
                            ("verify", "what ComfyUI and diffusers (and Forge for SDXL) would "
                             "apply, and each key they would drop")):
        p = tools.add_parser(name, help=help_text, description=help_text)
        p.add_argument("file", type=Path, metavar="FILE", help="a LoRA file (.safetensors)")
        _common(p, None)
    text = "the same LoRA in another layout"
    p = tools.add_parser("convert", help=text, description=text)
    p.add_argument("file", type=Path, metavar="FILE", help="a LoRA file (.safetensors)")
    p.add_argument("--to", required=True, choices=["comfy", "diffusers", "kohya"],
                   help="comfy: the layout ComfyUI reads in full; diffusers: PEFT names; "
                   "kohya: lora_unet_ names")
    p.add_argument("--base", type=Path, metavar="MODEL",
                   help="the diffusers folder or single file of the model FILE was trained "
                   "on, whose layout "
                   "SDXL/SD 1.5/SD3 original names are read in (default: the released "
                   "model's that fits the file)")
    _common(p, "FILE's name with -<layout>, beside it")
    text = "a LoRA at another rank (SVD per module)"
    p = tools.add_parser("resize", help=text, description=text)
    p.add_argument("file", type=Path, metavar="FILE", help="a LoRA file (.safetensors)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--rank", type=int, help="the new rank of every module")
    size.add_argument("--energy", type=float, help="keep the fewest singular values holding "
                      "this share of each module's update (e.g. 0.9)")
    _common(p, "FILE's name with -r<R> or -e<E>, beside it", family=False)
    text = "merge LoRAs into a base model file, or into one LoRA"
    p = tools.add_parser("merge", help=text, description=text)
    p.add_argument("base", type=Path, metavar="BASE", help="the denoiser's single file (or "
                   "diffusers-named file), or a LoRA to merge the others with")
    p.add_argument("--lora", action="append", required=True, metavar="PATH[:WEIGHT]",
                   help="a LoRA and its weight (default 1); repeat for several")
    p.add_argument("--rank", type=int, help="LoRA + LoRA: cut the merged LoRA to this rank by "
                   "SVD (default: the ranks concatenated, exact)")
    _common(p, "BASE's name with -merged, beside it")
    text = "a LoRA from the difference of two models of a family (SVD per module)"
    p = tools.add_parser("extract", help=text, description=text)
    p.add_argument("--base", type=Path, required=True, help="the base denoiser's file")
    p.add_argument("--tuned", type=Path, required=True, help="the fine-tuned (or merged) "
                   "denoiser's file, in the same layout")
    p.add_argument("--rank", type=int, required=True, help="the LoRA's rank")
    _common(p, "TUNED's name with -lora-r<R>, beside it")
