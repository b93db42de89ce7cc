"""What several verbs share: this process's place in a run, and a run's sample runner."""

from __future__ import annotations

from pathlib import Path

from difftune.config import RunConfig
from difftune.precision.policy import resolve_device
from difftune.report.logs import quiet_rank
from difftune.report.metrics import Reporter
from difftune.sample.runner import SampleRunner
from difftune.train.dist import Dist
from difftune.train.dist import init as init_dist
from difftune.train import watch
from difftune.train.nodes import Layout
from difftune.train.placement import require_shared
from difftune.train.setup import Run


def join(cfg: RunConfig) -> Dist:
    """This process's place in a multi-process run (launched by accelerate or torchrun), or
    a single process; only rank 0 then speaks on the console (warnings of others: errors only).
    Several processes start their heartbeats (train/watch.py), and several nodes must see the
    same run folder and disk caches (train/placement.py)."""
    dist = init_dist(resolve_device(cfg.train.device))
    if dist.world > 1:
        quiet_rank(dist.rank)
        watch.start(dist, cfg.save.dir / "checkpoints")
        folders = {"save.dir": cfg.save.dir}
        if "disk" in (cfg.cache.latents, cfg.cache.text) and cfg.cache.dir is not None:
            folders["cache.dir"] = cfg.cache.dir
        require_shared(dist, Layout.from_env(), folders)
    return dist


def sampler_for(run: Run, reporter: Reporter | None, out: Path) -> SampleRunner:
    """A sample runner whose default size is the first dataset's (largest) resolution."""
    res = max(run.cfg.datasets[0].resolutions)
    return SampleRunner(run.family, run.comps, run.texts, run.cfg.sample, out, (res, res),
                        run.policy, reporter)


def sample_prompts(runner: SampleRunner) -> list[str]:
    """Prompt and negative texts of the sample file now, so they are cached with the captions."""
    specs = runner.prompts()
    return [s.prompt for s in specs] + [s.negative for s in specs if s.cfg > 1.0]
