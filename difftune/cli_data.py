"""The `difftune caption` and `difftune dataset report` command lines (the dataset verbs),
kept apart from cli.py, which dispatches to them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The dataset verbs' parsers."""
    _caption_parser(verbs)
    _dataset_parser(verbs)


def _caption_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune caption DATASET_FOLDER --model PATH`: the verb's arguments."""
    text = "write a caption file beside each image and video, with a local captioning model"
    p = verbs.add_parser("caption", help=text, description=text)
    p.add_argument("folder", type=Path, nargs="?", metavar="DATASET_FOLDER",
                   help="the folder of images (or give --config)")
    p.add_argument("--config", type=Path, metavar="RUN.toml",
                   help="caption every dataset folder of this run file instead")
    p.add_argument("--model", type=Path, required=True, metavar="PATH", help="a local "
                   "Qwen2.5-VL/Qwen3-VL instruct, Florence-2 or LLaVA folder, a Qwen-Image or "
                   "Krea 2 folder (its text encoder), or a WD14 tagger folder")
    p.add_argument("--style", choices=["short", "detailed", "tags", "prompt"],
                   help="what to write (default: short; tags for a tagger)")
    p.add_argument("--prompt", help="the instruction for --style prompt")
    p.add_argument("--trigger", default="", metavar="WORD",
                   help="put this word first in each new caption (unless it holds it)")
    p.add_argument("--prefix", default="", metavar="TEXT", help="text before each new caption")
    p.add_argument("--max-tokens", type=int, default=160, metavar="N",
                   help="longest answer in tokens (default 160)")
    p.add_argument("--batch-size", type=int, default=4, metavar="N", help="images a batch")
    p.add_argument("--video-frames", type=int, default=4, metavar="N",
                   help="frames sampled evenly over each video to caption it (default 4)")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                   help="weights' dtype (default: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--quantize", choices=["none", "int8", "nf4"], default="none",
                   help="quantize the language model's weights (nf4: CUDA only)")
    write = p.add_mutually_exclusive_group()
    write.add_argument("--overwrite", action="store_true", help="replace existing captions")
    write.add_argument("--append", action="store_true", help="add to existing captions")
    p.add_argument("--threshold", type=float, default=0.35,
                   help="tagger: a general tag's least probability (default 0.35)")
    p.add_argument("--character-threshold", type=float, default=0.85,
                   help="tagger: a character tag's least probability (default 0.85)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: a line per caption written instead (for logs)")


def _dataset_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune dataset report DATASET_FOLDER|--config RUN.toml`: the verb's arguments."""
    text = "look at a dataset before training"
    dataset = verbs.add_parser("dataset", help=text, description=text)
    tools = dataset.add_subparsers(dest="tool", required=True)
    text = ("report near-duplicates, blurred, small or oddly shaped images, and missing, "
            "trigger-less or over-long captions")
    p = tools.add_parser("report", help=text, description=text)
    p.add_argument("folder", type=Path, nargs="?", metavar="DATASET_FOLDER",
                   help="the folder of images (or give --config)")
    p.add_argument("--config", type=Path, metavar="RUN.toml",
                   help="report on this run file's datasets (its resolutions, family, model)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--trigger", default="", metavar="WORD",
                   help="flag captions without this word")
    p.add_argument("--resolution", type=int, metavar="N",
                   help="folder: the training resolution (flags images it would upscale)")
    p.add_argument("--family", metavar="NAME",
                   help="folder: the model family (flags captions over its token limit)")
    p.add_argument("--caption-ext", default=".txt", help="folder: caption extension")
    p.add_argument("--duplicate-distance", type=int, default=6, metavar="BITS",
                   help="near-duplicates: perceptual hashes at most this far apart (default 6)")
    p.add_argument("--blur-threshold", type=float, default=100.0, metavar="X",
                   help="blurred: sharpness below this (default 100)")
    p.add_argument("--max-aspect", type=float, default=3.0, metavar="R",
                   help="extreme aspect ratio: beyond R:1 (default 3)")


def dataset(args: argparse.Namespace) -> int:
    """`difftune dataset report`: print the report (table or JSON); always 0: it informs."""
    from difftune.errors import ConfigError

    if (args.folder is None) == (args.config is None):
        raise ConfigError("give either DATASET_FOLDER or --config RUN.toml (its datasets)")
    from difftune.dataset_report.checks import Settings
    from difftune.dataset_report.render import table, to_json
    from difftune.verbs.dataset_report import config_report, folder_report

    settings = Settings(args.duplicate_distance, args.blur_threshold, args.max_aspect,
                        args.trigger)
    if args.config is not None:
        from difftune.config import load_config

        report = config_report(load_config(args.config, []), settings)
    else:
        if args.family is not None:
            from difftune.families.registry import names

            if args.family not in names():
                raise ConfigError(f"--family {args.family}: not a family; choose one of "
                                  f"{', '.join(names())}")
        report = folder_report(args.folder, settings, args.resolution, args.family,
                               args.caption_ext)
    print(to_json(report) if args.json else "\n".join(table(report)))
    return 0


def caption(args: argparse.Namespace) -> int:
    """`difftune caption`: caption the folder (or the run's datasets); 130 when stopped."""
    from difftune.errors import ConfigError

    if (args.folder is None) == (args.config is None):
        raise ConfigError("give either DATASET_FOLDER or --config RUN.toml (its datasets)")
    if min(args.max_tokens, args.batch_size, args.video_frames) < 1:
        raise ConfigError("--max-tokens, --batch-size and --video-frames must be at least 1")
    from difftune.verbs.caption import CaptionJob, Folder, folders_of, run_caption
    from difftune.caption.run import WritePolicy
    from difftune.caption.vlm import Hardware

    if args.config is not None:
        from difftune.config import load_config

        folders = folders_of(load_config(args.config, []))
    else:
        folders = [Folder(args.folder)]
    mode = "overwrite" if args.overwrite else "append" if args.append else "skip"
    job = CaptionJob(args.model, args.style, args.prompt, args.max_tokens, args.batch_size,
                     Hardware(args.device, args.precision, args.quantize),
                     WritePolicy(mode, args.prefix, args.trigger), args.threshold,
                     args.character_threshold, args.video_frames)
    def written(image: Path, text: str) -> None:
        print(f"captioned {image}: {text}", flush=True)  # a log's line per caption

    outcome, lines = run_caption(job, folders, show_progress=not args.no_progress,
                                 on_caption=written if args.no_progress else None)
    for line in lines:
        print(line)
    return 130 if outcome.stopped else 0
