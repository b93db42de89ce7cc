"""The `difftune` command line: parse, call, map errors to exit codes.

Exit codes: 0 success; 2 a user-fixable problem (config, data, model files, environment), shown
as one message without a traceback; 1 an internal error (traceback in the run log); 130 Ctrl-C;
3 `difftune lora verify` found keys a program would drop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from difftune import __version__, cli_cluster, cli_data, cli_runs
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
        if name == "check":
            p.add_argument("--nodes", type=int, default=1, metavar="N",
                           help="also print the layout, global batch and launch line of a run "
                           "on N machines")
            p.add_argument("--processes-per-node", type=int, default=1, metavar="G",
                           help="processes (GPUs) per machine for that layout (default 1)")
        if name in ("train", "cache"):
            p.add_argument("--num-processes", type=int, default=1, metavar="N",
                           help="data-parallel over N processes, one per GPU (runs accelerate "
                           "launch; for several machines use accelerate launch yourself)")
        if name == "train":
            p.add_argument("--resume", metavar="latest|PATH",
                           help="continue exactly from a checkpoint (latest in save.dir)")
        if name in ("train", "check"):
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
    cli_data.add_parsers(verbs)
    cli_cluster.add_parser(verbs)
    _lora_parser(verbs)
    cli_runs.add_parsers(verbs)
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


def _lora_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`difftune lora VERB ...`: the LoRA toolbox's arguments (verbs.lora_args)."""
    from difftune.verbs.lora_args import add_lora_parser

    add_lora_parser(verbs)


def _lora(args: argparse.Namespace) -> int:
    from difftune.verbs.lora import run

    text, status = run(args)
    print(text)
    return status


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
    from difftune.train import watch
    from difftune.train.dist import current
    from difftune.train.loop import Interrupted, StepFailed
    from difftune.verbs.train import run_train

    watch.hint = _resume_hint(args)  # said by a process that finds another one lost
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
        print(f"{what} written to {' and '.join(str(p) for p in result.loras or [result.lora])}")
    return 0


def _resume_hint(args: argparse.Namespace) -> str:
    """The command that continues this run from its latest checkpoint."""
    from difftune.train.nodes import Layout, resume_line

    layout = Layout.from_env()
    if layout.nodes > 1:
        return f"resume with: {resume_line(layout, str(args.config), args.overrides)}"
    sets = "".join(f" --set {o}" for o in args.overrides)
    sets += f" --num-processes {layout.world}" if layout.world > 1 else ""
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
    its connection, or reset it when its node was lost; NCCL: a distributed backend error)."""
    import torch.distributed as td

    text = str(err)
    return (isinstance(err, getattr(td, "DistError", ())) or "closed by peer" in text
            or "reset by peer" in text)


def _rank_tag() -> str:
    """"[rank N] " before a message of one process of a multi-process launch, else ""."""
    from difftune.train.world import launched

    return f"[rank {os.environ.get('RANK', '0')}] " if launched() else ""


def _check(args: argparse.Namespace) -> int:
    from difftune.config import load_config

    cfg = load_config(args.config, args.overrides)  # before torch: a mistake shows at once
    from difftune.verbs.check import run_check

    if args.nodes < 1 or args.processes_per_node < 1:
        from difftune.errors import ConfigError

        raise ConfigError("--nodes and --processes-per-node count machines and processes: "
                          "give 1 or more")
    lines = run_check(cfg, args.init_lora)
    if args.nodes > 1 or args.processes_per_node > 1:
        from difftune.train.nodes import Layout, describe

        tail = ["train", str(args.config)] + [a for o in args.overrides for a in ("--set", o)]
        lines += describe(Layout(args.nodes, args.processes_per_node), cfg.train.batch_size,
                          cfg.train.grad_accum, cfg.train.lr, tail)
    for line in lines:
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
    "ui": _ui, "request": _request, "import": _import, "caption": cli_data.caption,
    "dataset": cli_data.dataset, "slurm": cli_cluster.slurm, "lora": _lora,
    "runs": cli_runs.runs, "sweep": cli_runs.sweep,
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
            _settle()  # a lost node is named there (and this process ends)
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
    finally:
        _leave()


def _settle() -> None:
    """After a collective failed: give the heartbeats time to tell a lost node (reported by
    train/watch.py, which then ends the process) from a process that failed with its own error."""
    module = sys.modules.get("difftune.train.watch")
    running = module.active() if module is not None else None
    if running is not None:
        running.settle()


def _leave() -> None:
    """Tell the other processes (their heartbeats) that this one leaves of its own accord."""
    module = sys.modules.get("difftune.train.watch")
    if module is not None:
        module.leave()


if __name__ == "__main__":
    raise SystemExit(main())
