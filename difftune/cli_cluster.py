"""The `difftune slurm` command line (submit, status, cancel), kept apart from cli.py, which
dispatches to it."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune slurm submit|status|cancel`: the verb's arguments."""
    text = "hand a run to SLURM (sbatch script next to the run) and follow it"
    actions = verbs.add_parser("slurm", help=text, description=text).add_subparsers(
        dest="action", required=True)
    p = actions.add_parser("submit", help="write <save.dir>/slurm.sbatch and submit it")
    p.add_argument("config", type=Path, help="the run's TOML file")
    p.add_argument("--nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, metavar="G",
                   help="GPUs per machine, one training process each (0: CPU nodes, gloo)")
    for name in ("partition", "time", "account"):
        p.add_argument(f"--{name}", help=f"SLURM's --{name}")
    p.add_argument("--extra", action="append", default=[], metavar="OPTION",
                   help="a further sbatch option, e.g. --extra=--qos=high (repeatable)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true",
                   help="submit a run folder that already holds checkpoints (it resumes)")
    for action in ("status", "cancel"):
        q = actions.add_parser(action, help=f"{action} a job (its id, or the run folder)")
        q.add_argument("job", metavar="JOB|RUN_DIR")


def slurm(args: argparse.Namespace) -> int:
    """`difftune slurm submit|status|cancel`: submit a run, or follow or cancel its job."""
    from difftune.verbs import slurm

    if args.action == "status":
        print(slurm.run_status(args.job).describe())
    elif args.action == "cancel":
        print(f"job {slurm.run_cancel(args.job)} cancelled")
    else:
        from difftune.cluster.script import Request
        from difftune.config import load_config

        cfg = load_config(args.config, args.overrides)
        req = Request(args.nodes, args.gpus_per_node, args.partition, args.time,
                      args.account, args.extra)
        job, path = slurm.run_submit(cfg, args.config, args.overrides, req, args.resume)
        print(f"submitted job {job} ({path}); follow it with: difftune slurm status "
              f"{cfg.save.dir}")
    return 0
