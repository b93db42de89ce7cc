"""`difftune sweep config.toml --space sweep.toml`: an Optuna study whose trials are real runs.

Each trial is a `difftune train` job in the web app's queue (`<root>/.difftune-ui/jobs.sqlite`:
it survives restarts and shows in the UI), training into `<save.dir>/trial-NNN` with the
trial's values as `--set` overrides and `save.keep_best` = the sweep's metric, so every trial
folder is an ordinary run with its own best checkpoint. While a trial trains, each measured
step's metric is reported to Optuna and the pruner may stop the job (SIGTERM: it saves a
checkpoint and exits). The study lives in Optuna's storage (SQLite `study.db` in the sweep
folder by default). Stopping the sweep stops its running trial cleanly; a rerun continues the
study: an unfinished trial's job is resumed (`--resume latest`), then new trials are asked for.
When no `difftune ui` serves the queue, the sweep runs it itself.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

from difftune.config.keep_best import Measure
from difftune.config.load import load_config
from difftune.config.sweep import SpaceFile, check_space, grid, overrides, read_space, render
from difftune.config.sweep import suggest
from difftune.errors import ConfigError
from difftune.verbs.rank import FIGURES, read_rows

log = logging.getLogger("difftune")
POLL_S = 0.5


def _study(space: SpaceFile, folder: Path, name: str, measure: Measure) -> Any:
    """The Optuna study (created, or loaded to continue)."""
    import optuna

    s = space.sweep
    storage = s.storage or f"sqlite:///{(folder / 'study.db').as_posix()}"
    # A grid is every combination enqueued in order (GridSampler stops the study itself,
    # which Optuna allows only inside `optimize`; trials here are asked and told).
    sampler = (optuna.samplers.TPESampler(seed=s.seed) if s.sampler == "tpe"
               else optuna.samplers.RandomSampler(seed=s.seed))
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
              if s.pruner == "median" else optuna.pruners.NopPruner())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=s.study or name, sampler=sampler,
                                pruner=pruner, load_if_exists=True,
                                direction="maximize" if measure.higher else "minimize")
    if s.sampler == "grid" and not study.get_trials(deepcopy=False):
        points = grid(space)
        for combo in itertools.product(*points.values()):
            study.enqueue_trial(dict(zip(points, combo)))
    return study


class Sweep:
    """One sweep process: the study, the queue, and the trial being followed."""

    def __init__(self, config: Path, space: SpaceFile, queue: Any,
                 stop: Callable[[], bool]) -> None:
        cfg = load_config(config)
        self.config, self.space, self.queue, self.stop = config, space, queue, stop
        self.measure = Measure(space.sweep.metric)
        self.folder = cfg.save.dir
        self.folder.mkdir(parents=True, exist_ok=True)
        self.study = _study(space, self.folder, cfg.save.name, self.measure)

    def base_sets(self, run_dir: Path) -> list[str]:
        """What every trial sets besides its values: its folder and the best-checkpoint rule."""
        return [f"save.dir={render(str(run_dir))}",
                f"save.keep_best={render(self.measure.text)}"]

    def run(self) -> int:
        """Follow unfinished trials, then ask for new ones until the study holds `trials`;
        returns 130 when stopped (the study continues on a rerun), else 0."""
        import optuna

        state = optuna.trial.TrialState
        while not self.stop():
            trials = self.study.get_trials(deepcopy=False)
            running = [t for t in trials if t.state == state.RUNNING]
            started = [t for t in trials if t.state != state.WAITING]
            self.write_table()  # what the web app's /sweep page shows, kept current
            if running:
                self.follow(optuna.trial.Trial(self.study, running[0]._trial_id))
            elif len(started) < self.space.sweep.trials and (
                    self.space.sweep.sampler != "grid" or len(started) < len(trials)):
                self.start(self.study.ask())
            else:
                return 0
        return 130

    def write_table(self) -> list[dict[str, Any]]:
        """The study's table into `<save.dir>/sweep.json` (atomically); returns it."""
        rows = table(self.study)
        tmp = self.folder / ".sweep.json.tmp"
        tmp.write_text(json.dumps({"metric": self.measure.text, "trials": rows}, indent=1),
                       encoding="utf-8")
        tmp.replace(self.folder / "sweep.json")
        return rows

    def start(self, trial: Any) -> None:
        """Draw the trial's values and queue its training job."""
        params = suggest(trial, self.space)
        run_dir = self.folder / f"trial-{trial.number:03d}"
        args = [a for item in [*self.base_sets(run_dir), *overrides(params)]
                for a in ("--set", item)]
        job = self.queue.submit("train", self.config, args)
        trial.set_user_attr("run_dir", str(run_dir))
        trial.set_user_attr("job", job.id)
        log.info("trial %d: %s (job %d, %s)", trial.number, params, job.id, run_dir)

    def follow(self, trial: Any) -> None:
        """Report the trial's measured steps until its job ends, stopping the job when Optuna
        prunes the trial or the sweep is asked to stop (once: a second stop would kill it);
        then `finish`."""
        job_id, run_dir = trial.user_attrs["job"], Path(trial.user_attrs["run_dir"])
        reported: set[int] = set()
        pruned = stopping = False
        while True:
            job = self.queue.get(job_id)
            fresh = [(s, v) for s, v in self.values(run_dir) if s not in reported]
            for step, value in fresh:
                reported.add(step)
                trial.report(value, step)
            if job.finished:
                return self.finish(trial, job, pruned)
            if not stopping and self.stop():
                stopping = True
                trial.set_user_attr("stopped", True)  # a rerun continues it
                self.queue.stop(job_id)
            elif not stopping and fresh and trial.should_prune():
                pruned = stopping = True
                log.info("trial %d: pruned at step %d, stopping job %d", trial.number,
                         fresh[-1][0], job_id)
                self.queue.stop(job_id)
            time.sleep(POLL_S)

    def finish(self, trial: Any, job: Any, pruned: bool) -> None:
        """Tell the study how the trial ended; a job the user stopped is left for a rerun,
        which resumes it (or queues it again when it never started)."""
        import optuna

        values = dict(self.values(Path(trial.user_attrs["run_dir"])))
        if pruned:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        elif job.state == "succeeded" and values:
            sign = 1 if self.measure.higher else -1
            best = max(values, key=lambda s: sign * values[s])
            self.study.tell(trial, values[best])
            log.info("trial %d: %s = %.6g (step %d)", trial.number, self.measure.text,
                     values[best], best)
        elif self.stop():
            return
        elif job.state in ("stopped", "died") and job.checkpoints:
            trial.set_user_attr("job", self.queue.resume(job.id).id)
            trial.set_user_attr("stopped", False)
        elif trial.user_attrs.get("stopped") or job.state == "cancelled":
            # Stopped before its first checkpoint: trained again from the start, in the
            # trial's own folder (what the stopped job left there is the sweep's, not a user's).
            args = [*job.args, "--set", "save.overwrite=true"]
            trial.set_user_attr("job", self.queue.submit("train", job.config, args).id)
            trial.set_user_attr("stopped", False)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            log.warning("trial %d failed (job %d %s): see %s", trial.number, job.id,
                        job.state, job.log)

    def values(self, run_dir: Path) -> list[tuple[int, float]]:
        """(step, metric) of each step of the trial's run where every named metric is
        measured."""
        by_step: dict[int, dict[str, float]] = {}
        for row in read_rows(run_dir):
            figures = {k: row[k] for k in FIGURES
                       if isinstance(row.get(k), (int, float)) and not isinstance(row[k], bool)}
            by_step.setdefault(row["step"], {}).update(figures)
        return [(s, self.measure.value(f)) for s, f in sorted(by_step.items())
                if self.measure.names <= set(f)]


def table(study: Any) -> list[dict[str, Any]]:
    """The study's table: each trial's state, values, metric and best checkpoint."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        run_dir = Path(t.user_attrs.get("run_dir", ""))
        best = {}
        try:
            best = json.loads((run_dir / "best.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
        rows.append({"trial": t.number, "state": t.state.name.lower(), "params": t.params,
                     "value": t.value, "run_dir": str(run_dir),
                     "best_step": best.get("best_step"),
                     "best_file": str(run_dir / best["file"]) if best.get("file") else None})
    return rows


def prepare(config: Path, space_path: Path, root: Path) -> SpaceFile:
    """The space, with every trial's config validated up front (ConfigError: exit 2); the run
    file and its save.dir (the trials' parent) must lie under `root`, whose queue runs them."""
    from difftune.ui.security import PathOutsideRoots, Roots

    if not config.is_file():
        raise ConfigError(f"config file {config} does not exist; pass the path of a .toml run "
                          "file")
    try:
        roots = Roots.of([root])
        roots.resolve(config)
        roots.resolve(load_config(config).save.dir, write=True)
    except (PathOutsideRoots, ValueError) as err:
        raise ConfigError(f"{err}; run the sweep with --root a folder holding both the run "
                          "file and its save.dir") from None
    space = read_space(space_path)
    measure = Measure(space.sweep.metric)
    check_space(config, space, [f"save.keep_best={render(measure.text)}"])
    return space


def open_queue(root: Path) -> tuple[Any, Any]:
    """The web app's job queue under `root`, and its lock when this process runs it (no
    `difftune ui` serves it); with a UI serving it, jobs are only submitted here."""
    from difftune.ui.jobs.queue import JobQueue
    from difftune.ui.security import Roots
    from difftune.ui.server import hold_lock

    roots = Roots.of([root])
    state = roots.main / ".difftune-ui"
    state.mkdir(parents=True, exist_ok=True)
    try:
        lock = hold_lock(state / "ui.lock")
    except ValueError:
        lock = None
    queue = JobQueue(state / "jobs.sqlite", roots)
    if lock is not None:
        queue.start()
    return queue, lock


def run_sweep(config: Path, space_path: Path, root: Path) -> int:
    """The whole sweep; prints the study's table and writes it to sweep.json."""
    from difftune.verbs.train import stop_signals

    space = prepare(config, space_path, root)
    queue, lock = open_queue(root)
    try:
        with stop_signals() as stop:
            sweep = Sweep(config.resolve(), space, queue, stop)
            code = sweep.run()
        for r in sweep.write_table():
            value = "-" if r["value"] is None else f"{r['value']:.6g}"
            print(f"trial {r['trial']:3d}  {r['state']:9s}  {value:>12s}  {r['params']}  "
                  f"{r['best_file'] or r['run_dir']}")
        if code:
            print("sweep stopped: run the same command again to continue the study")
        return code
    finally:
        queue.close()
        if lock is not None:
            lock.close()
