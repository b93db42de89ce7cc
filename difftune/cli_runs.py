"""The `difftune runs rank` and `difftune sweep` command lines (looking across runs),
kept apart from cli.py, which dispatches to them."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parsers(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """The `runs` and `sweep` verbs' parsers."""
    _runs_parser(verbs)
    text = "search settings with Optuna: each trial a real train job in the web app's queue"
    sweep = verbs.add_parser("sweep", help=text, description=text)
    sweep.add_argument("config", type=Path, help="the run's TOML file (the trials' base)")
    sweep.add_argument("--space", type=Path, required=True, help="the search space (TOML)")
    sweep.add_argument("--root", type=Path, default=None, help="the web app's first root, "
                       "whose job queue runs the trials (default: the current folder)")


def _runs_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune runs rank RUN_FOLDER...`: the verb's arguments."""
    runs = verbs.add_parser("runs", help="look across runs: rank their checkpoints",
                            description="look across runs: rank their checkpoints")
    what = runs.add_subparsers(dest="runs_verb", required=True)
    text = "rank the checkpoints of one or more runs by a metric (best first)"
    p = what.add_parser("rank", help=text, description=text)
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_FOLDER")
    p.add_argument("--by", metavar="METRIC", help="a metric or weighted combination, as "
                   "save.keep_best (default: the run's keep_best, else fidelity, else val_loss)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--dino", type=Path, help="DINOv2 folder to measure unmeasured samples")
    p.add_argument("--clip", type=Path, help="CLIP folder to measure unmeasured samples")


def runs(args: argparse.Namespace) -> int:
    """`difftune runs rank`: the checkpoints of runs ranked by a metric."""
    from difftune.verbs.rank import as_json, rank, table

    by, entries = rank(args.run_dirs, args.by, args.dino, args.clip)
    print(as_json(by, entries) if args.json else "\n".join(table(by, entries)))
    return 0


def sweep(args: argparse.Namespace) -> int:
    """`difftune sweep`: an Optuna study whose trials are train jobs."""
    from difftune.verbs.sweep import run_sweep

    return run_sweep(args.config, args.space, args.root or Path.cwd())
