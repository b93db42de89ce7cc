"""The `difftune` command line: parse, call, map errors to exit codes.

Exit codes: 0 success; 2 a user-fixable problem (config, data, model files, environment), shown
as one message without a traceback; 1 an internal error (traceback in the run log); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from difftune import __version__
from difftune.errors import DifftuneError
from difftune.report.logs import current_run_log, setup_console

if TYPE_CHECKING:
    from difftune.train.loop import StepFailed

log = logging.getLogger("difftune")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="difftune", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"difftune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug messages")
    verbs = parser.add_subparsers(dest="verb", required=True)
    for name, text in (("train", "train a LoRA from a TOML run file"),
                       ("check", "verify a run in seconds: config, data, model, one step, one sample"),
                       ("cache", "fill the run's disk caches (latents, text) without training")):
        p = verbs.add_parser(name, help=text, description=text)
        p.add_argument("config", type=Path, help="the run's TOML file")
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a config field, e.g. train.lr=2e-4")
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        if name == "cache":
            p.add_argument("--prune", action="store_true",
                           help="first delete the entries this config no longer references")
        if name in ("train", "cache"):
            p.add_argument("--num-processes", type=int, default=1, metavar="N",
                           help="data-parallel over N processes, one per GPU (runs accelerate "
                           "launch; for several machines use accelerate launch yourself)")
        if name == "train":
            p.add_argument("--resume", metavar="latest|PATH",
                           help="continue exactly from a checkpoint (latest in save.dir)")
            p.add_argument("--init-lora", type=Path, metavar="PATH",
                           help="start a new run from this LoRA file's weights")
    text = "generate images from the base model and zero or more LoRAs"
    sample = verbs.add_parser("sample", help=text, description=text)
    sample.add_argument("config", type=Path, help="a run's TOML file (model, precision, sample)")
    sample.add_argument("--lora", action="append", default=[], metavar="PATH[:WEIGHT]",
                        help="a LoRA file and its weight (default 1); repeat for several")
    sample.add_argument("--prompts", type=Path, help="prompt file (default: sample.prompts)")
    sample.add_argument("--out", type=Path, help="output folder (default: <save.dir>/samples)")
    sample.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field")
    ui = verbs.add_parser("ui", help="serve the web app: prepare, launch, watch and compare runs",
                          description="serve the web app: prepare, launch, watch and compare runs")
    ui.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1; any other needs the printed token)")
    ui.add_argument("--port", type=int, default=8765, help="port (default 8765)")
    ui.add_argument("--root", dest="roots", action="append", type=Path, default=[],
                    metavar="DIR", help="a folder the app may read and write under (repeatable; "
                    "default: the current folder); runs and the job queue live in the first")
    text = "ask a training run to sample or save after its current step"
    request = verbs.add_parser("request", help=text, description=text)
    request.add_argument("kind", choices=["sample", "save"], help="what to do now")
    request.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run's save.dir")
    _import_parser(verbs)
    _runs_parser(verbs)
    text = "search settings with Optuna: each trial a real train job in the web app's queue"
    sweep = verbs.add_parser("sweep", help=text, description=text)
    sweep.add_argument("config", type=Path, help="the run's TOML file (the trials' base)")
    sweep.add_argument("--space", type=Path, required=True, help="the search space (TOML)")
    sweep.add_argument("--root", type=Path, default=None, help="the web app's first root, "
                       "whose job queue runs the trials (default: the current folder)")
    demo = verbs.add_parser("demo", help="train the tiny built-in model on bundled data (CPU)")
    demo.add_argument("--out", type=Path, default=Path("difftune-demo"), help="output folder")
    demo.add_argument("--steps", type=int, default=None, help="override the demo's step count")
    return parser


def _import_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune import TRAINER FILE`: the verb's arguments."""
    from difftune.families.registry import names
    from difftune.importers import TRAINERS

    text = "turn another trainer's config into a difftune run file, saying what maps"
    p = verbs.add_parser("import", help=text, description=text)
    p.add_argument("trainer", choices=list(TRAINERS), help="the trainer that wrote FILE")
    p.add_argument("file", type=Path, metavar="FILE", help="its config file")
    p.add_argument("--out", type=Path, help="the run file to write (default: "
                   "FILE's name with .difftune.toml, in the current folder)")
    p.add_argument("--family", choices=names(), help="the model family, where FILE does not "
                   "say it")
    p.add_argument("--force", action="store_true", help="replace an existing run file")


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


def _runs(args: argparse.Namespace) -> int:
    from difftune.verbs.rank import as_json, rank, table

    by, entries = rank(args.run_dirs, args.by, args.dino, args.clip)
    print(as_json(by, entries) if args.json else "\n".join(table(by, entries)))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from difftune.verbs.sweep import run_sweep

    return run_sweep(args.config, args.space, args.root or Path.cwd())


def _import(args: argparse.Namespace) -> int:
    from difftune.verbs.import_config import run_import

    command = " ".join(["difftune", "import", args.trainer, str(args.file)]
                       + (["--out", str(args.out)] if args.out else []))
    run_import(args.trainer, args.file, args.out, args.force, args.family, command)
    return 0


def _train(args: argparse.Namespace) -> int:
    from difftune.config import load_config

    if args.resume and args.init_lora:
        print("error: --resume continues a run and --init-lora starts a new one; give one",
              file=sys.stderr)
        return 2
    # The config first: its mistakes are reported before torch and the model libraries load.
    cfg = load_config(args.config, args.overrides)
    from difftune.train.dist import current
    from difftune.train.loop import Interrupted, StepFailed
    from difftune.verbs.train import run_train

    try:
        result = run_train(cfg, show_progress=not args.no_progress, resume=args.resume,
                           init_lora=args.init_lora)
    except Interrupted as stop:
        if current().main:
            print(f"stopped after step {stop.step}; checkpoint saved to {stop.path}\n"
                  + _resume_hint(args))
        return 0
    except StepFailed as failed:
        return _step_failed(failed, args)
    if current().main:
        what = "fine-tuned model" if cfg.adapter.type == "full" else "LoRA"
        print(f"{what} written to {result.lora}")
    return 0


def _resume_hint(args: argparse.Namespace) -> str:
    """The command that continues this run from its latest checkpoint."""
    from difftune.train.dist import current

    world = current().world
    sets = "".join(f" --set {o}" for o in args.overrides)
    sets += f" --num-processes {world}" if world > 1 else ""
    return f"resume with: difftune train {args.config}{sets} --resume latest"


def _step_failed(failed: StepFailed, args: argparse.Namespace) -> int:
    """A step failed mid-run: the error as usual, then where the last good step was saved
    and how to resume once the cause is fixed."""
    cause = failed.cause
    log.debug("step %d failed:\n%s", failed.step, "".join(
        traceback.format_exception(type(cause), cause, cause.__traceback__)))
    where = current_run_log()
    if isinstance(cause, DifftuneError):
        print(f"{_rank_tag()}error: {cause}", file=sys.stderr)
    else:
        print(f"{_rank_tag()}internal error at step {failed.step}: {type(cause).__name__}: "
              f"{cause}" + (f" (traceback in {where})" if where else ""), file=sys.stderr)
    if failed.path is not None:
        print(f"the last good step ({failed.step - 1}) was saved to {failed.path}; once the "
              f"cause is fixed, {_resume_hint(args)}", file=sys.stderr)
    return cause.exit_code if isinstance(cause, DifftuneError) else 1


def _peer_failed(err: Exception) -> bool:
    """Whether `err` is a collective broken by another process's exit (gloo: the peer closed
    its connection; NCCL: a distributed backend error)."""
    import torch.distributed as td

    return isinstance(err, getattr(td, "DistError", ())) or "closed by peer" in str(err)


def _rank_tag() -> str:
    """"[rank N] " before a message of one process of a multi-process launch, else ""."""
    from difftune.train.world import launched

    return f"[rank {os.environ.get('RANK', '0')}] " if launched() else ""


def _check(args: argparse.Namespace) -> int:
    from difftune.config import load_config

    cfg = load_config(args.config, args.overrides)  # before torch: a mistake shows at once
    from difftune.verbs.check import run_check

    for line in run_check(cfg):
        # Detail lines (indented) belong to the check above them.
        print(f"    {line.strip()}" if line.startswith(" ") else f"ok  {line}")
    print("check passed: this run should start and train")
    return 0


def _cache(args: argparse.Namespace) -> int:
    from difftune.config import load_config

    cfg = load_config(args.config, args.overrides)  # before torch: a mistake shows at once
    from difftune.train.dist import current
    from difftune.verbs.cache import run_cache

    lines = run_cache(cfg, prune=args.prune, show_progress=not args.no_progress)
    for line in lines if current().main else []:
        print(line)
    return 0


def _one_process(verb: str) -> None:
    """`check`, `sample` and `demo` run in one process; refuse them under a multi-process launch."""
    from difftune.errors import ConfigError
    from difftune.train.world import launched

    if launched() and verb not in ("train", "cache"):
        raise ConfigError(f"difftune {verb} runs in one process; start it without accelerate "
                          "launch / torchrun (only train and cache run on several)")


def _sample(args: argparse.Namespace) -> int:
    from difftune.config import load_config

    cfg = load_config(args.config, args.overrides)  # before torch: a mistake shows at once
    from difftune.verbs.sample import LoraArg, run_sample

    loras = [LoraArg.parse(text) for text in args.lora]
    paths = run_sample(cfg, loras, args.prompts, args.out)
    for path in paths:
        print(path)
    print(f"{len(paths)} image(s) written" if paths else "no images written (see the warnings)")
    return 0 if paths else 2


def _demo(args: argparse.Namespace) -> int:
    from difftune.train.loop import Interrupted
    from difftune.verbs.demo import run_demo

    try:
        report = run_demo(args.out, steps=args.steps)
    except Interrupted as stop:
        # Ctrl-C is a request, not a failure: say what was left (a checkpoint, no figures)
        # and leave with the conventional status of a SIGINT.
        print(f"interrupted after step {stop.step}: the demo did not finish, so no figures "
              f"were drawn; {args.out} holds its partial run (checkpoint {stop.path}): delete "
              "it, or give another --out, to run the demo again", file=sys.stderr)
        return 130
    print(report)
    return 0


def _request(args: argparse.Namespace) -> int:
    from difftune.verbs.request import run_request

    for line in run_request(args.run_dir, args.kind):
        print(line)
    return 0


def _ui(args: argparse.Namespace) -> int:
    from difftune.errors import ConfigError
    from difftune.ui.server import serve

    try:
        return serve(args.host, args.port, args.roots or [Path.cwd()])
    except ValueError as err:
        raise ConfigError(str(err)) from None


VERBS: dict[str, Callable[[argparse.Namespace], int]] = {
    "train": _train, "check": _check, "cache": _cache, "sample": _sample, "demo": _demo,
    "ui": _ui, "request": _request, "import": _import, "runs": _runs,
    "sweep": _sweep,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and `python -m difftune`."""
    args = _parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub
    # The libraries configure their own loggers on import; these keep their notices (e.g. about
    # optional backends) off the console. Set them to "warning" to see those notices.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    setup_console(args.verbose)
    tag = _rank_tag()
    try:
        _one_process(args.verb)
        if getattr(args, "num_processes", 1) > 1 and not tag:
            from difftune.config import load_config

            load_config(args.config, args.overrides)  # a mistake once, before N processes start
            from difftune.verbs.launch import launch

            return launch(args.num_processes, sys.argv[1:] if argv is None else argv)
        return VERBS[args.verb](args)
    except DifftuneError as err:
        log.debug("user-fixable error:\n%s", traceback.format_exc())
        print(f"{tag}error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if tag and _peer_failed(err):
            log.debug("collective failed:\n%s", traceback.format_exc())
            print(f"{tag}stopped: a collective with the other processes failed ({type(err).__name__}"
                  "); another process of this run failed first, its error is above",
                  file=sys.stderr)
            return 1
        where = current_run_log()
        log.debug("internal error:\n%s", traceback.format_exc())
        if where is None:
            traceback.print_exc()
        print(f"{tag}internal error: {type(err).__name__}: {err}"
              + (f" (traceback in {where})" if where else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
