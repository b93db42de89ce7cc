"""Loading a family made of one transformer, one VAE, one decoder-LLM text encoder and its
tokenizer, from a diffusers folder with single files over it (Z-Image, Qwen-Image, FLUX.2,
Krea 2 all ship this way).

Each component comes from its single file when the config names one (`model.transformer`,
`model.vae`, `model.text_encoder`), else from the folder's subfolder; the tokenizer always
comes from the folder (no single file carries it), the scheduler from the folder or, when it
has none, from the released config the family gives. The fingerprint covers every weight file
read, so caches follow the files.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from difftune.families.common.folders import folder_files, from_folder
from difftune.families.common.single_file import fingerprint

if TYPE_CHECKING:
    from difftune.config import ModelConfig

log = logging.getLogger(__name__)

FileLoader = Callable[[Path, torch.dtype], Any]


@dataclass(frozen=True)
class FolderLayout:
    """One family's classes and loaders: `what` names it in errors, `transformer`/`vae` are the
    diffusers classes of those subfolders, `transformer_file`/`vae_file` read single files,
    `scheduler_config` is the released scheduler's config (used when the folder has none),
    `scheduler` its class (None: FlowMatchEulerDiscreteScheduler), `denoiser` the pipeline's
    name (and the folder's subfolder) of the transformer that is trained, `scheduler_unknown`
    what to warn when the folder has no scheduler, where releases differ only in theirs,
    `tokenizer` the subfolder the tokenizer is read from."""

    what: str
    transformer: Any
    vae: Any
    transformer_file: FileLoader
    vae_file: FileLoader
    scheduler_config: dict[str, Any]
    scheduler: Any = None
    denoiser: str = "transformer"
    scheduler_unknown: str | None = None
    # Further denoisers read the same way, by pipeline name (a two-expert model's second,
    # `transformer_2`: the folder's subfolder, or the single file `model.<name>`).
    others: tuple[str, ...] = ()
    tokenizer: str = "tokenizer"


def _component(folder: Path, file: Path | None, sub: str, cls: Any, load_file: FileLoader,
               dtype: torch.dtype, what: str, used: list[Path], subs: list[str]) -> Any:
    """One weighted component from its file if given, else the folder's `sub`; records which."""
    if file is not None:
        used.append(Path(file))
        return load_file(Path(file), dtype)
    subs.append(sub)
    return from_folder(cls, folder, sub, dtype, what)


def load_components(cfg: "ModelConfig", dtypes: dict[str, torch.dtype], folder: Path,
                    layout: FolderLayout,
                    text_encoders: Callable[["ModelConfig", torch.dtype], dict[str, Any]],
                    extra_files: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Every component by its pipeline name, plus "name" and "fingerprint" (of the weight
    files read and `extra_files`). `text_encoders(cfg, dtype)` loads the text encoder."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import AutoTokenizer

    used: list[Path] = [Path(cfg.text_encoder)] if cfg.text_encoder is not None else []
    subs = [layout.tokenizer] + (["text_encoder"] if cfg.text_encoder is None else [])
    transformer = _component(folder, cfg.transformer, layout.denoiser, layout.transformer,
                             layout.transformer_file, dtypes[layout.denoiser], layout.what,
                             used, subs)
    others = {part: _component(folder, getattr(cfg, part), part, layout.transformer,
                               layout.transformer_file, dtypes[part], layout.what, used, subs)
              for part in layout.others}
    vae = _component(folder, cfg.vae, "vae", layout.vae, layout.vae_file, dtypes["vae"],
                     layout.what, used, subs)
    scheduler_class = layout.scheduler or FlowMatchEulerDiscreteScheduler
    if (folder / "scheduler").is_dir():
        scheduler = from_folder(scheduler_class, folder, "scheduler", None, layout.what)
        subs.append("scheduler")
    else:
        scheduler = scheduler_class(**layout.scheduler_config)
        if layout.scheduler_unknown:
            log.warning("%s", layout.scheduler_unknown)
    return {
        layout.denoiser: transformer, **others, "vae": vae, "scheduler": scheduler,
        "tokenizer": from_folder(AutoTokenizer, folder, layout.tokenizer, None, layout.what),
        **text_encoders(cfg, dtypes["text_encoders"]),
        "name": Path(cfg.transformer).stem if cfg.transformer is not None else folder.name,
        "fingerprint": fingerprint(folder_files(folder, subs)[1:] + list(extra_files) + used),
    }
