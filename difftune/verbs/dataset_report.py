"""`difftune dataset report`: the dataset report (dataset_report/) of a folder or of a run's
datasets, and the summary line `difftune check` prints."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from difftune.dataset_report.build import build_report, token_limit
from difftune.dataset_report.checks import Folder, Report, Settings
from difftune.dataset_report.render import summary_line
from difftune.errors import DataError

if TYPE_CHECKING:
    from difftune.config import RunConfig

log = logging.getLogger("difftune")


def config_folders(cfg: "RunConfig") -> list[Folder]:
    """Every subset folder of a run's datasets, with the buckets of its dataset's first
    resolution (the family's bucket step where the dataset sets none) and whether the family
    trains clips."""
    from difftune.data.clips import clip_rule
    from difftune.data.discover import dataset_buckets
    from difftune.families.registry import spec

    fam = spec(cfg.model.family, cfg.model.variant)
    clips = clip_rule(fam) is not None
    return [Folder(sub.path, sub.caption_ext, sub.recursive,
                   tuple(dataset_buckets(ds, fam.bucket_step)), sub, clips)
            for ds in cfg.datasets for sub in ds.subsets if sub.path.is_dir()]


def config_report(cfg: "RunConfig", settings: Settings) -> Report:
    """The report on a run's datasets, caption lengths against its family's token limit."""
    from difftune.families.common.folders import model_folder

    return build_report(config_folders(cfg), settings,
                        token_limit(cfg.model.family, model_folder(cfg.model)))


def folder_report(folder: Path, settings: Settings, resolution: int | None = None,
                  family: str | None = None, caption_ext: str = ".txt") -> Report:
    """The report on one folder: upscaling against `resolution`'s buckets (the family's bucket
    step, 64 without one), caption lengths against `family`'s token limit (approximate)."""
    from difftune.config import DatasetConfig
    from difftune.data.clips import clip_rule
    from difftune.data.discover import dataset_buckets
    from difftune.families.registry import spec

    if not folder.is_dir():
        raise DataError(f"dataset folder {folder} does not exist or is not a folder")
    buckets: tuple = ()
    if resolution is not None:
        step = spec(family).bucket_step if family else 64
        ds = DatasetConfig(path=folder, resolution=resolution,
                           min_side=min(256, resolution), max_side=max(2048, resolution))
        buckets = tuple(dataset_buckets(ds, step))
    limit = token_limit(family, None) if family else None
    clips = family is not None and clip_rule(spec(family)) is not None
    return build_report([Folder(folder, caption_ext, True, buckets, clips=clips)], settings,
                        limit)


def check_summary(cfg: "RunConfig") -> list[str]:
    """The report's summary line for `difftune check`; a failure is a warning, never a stop."""
    try:
        return [summary_line(config_report(cfg, Settings())) + " (details: difftune dataset "
                "report --config RUN.toml)"]
    except Exception as err:  # the report informs; it never stops a check or a run
        log.warning("the dataset report could not be made: %s", err)
        return []
