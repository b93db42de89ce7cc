"""Value conversions the three readers share: model sources, paths, dtypes, optimizers,
schedules, resolutions, and steps from epochs. Tables here are keyed by each trainer's own
spelling, lowercased, so a reader only names its table."""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from difftune.config import objectives
from difftune.data.discover import IMAGE_EXTENSIONS
from difftune.errors import ConfigError
from difftune.families import registry
from difftune.importers.families import TABLES
from difftune.importers.notes import NoEquivalent, To, Translation, src
from difftune.train.optimizers.specs import OPTIMIZERS, parse_args

# Optimizer names as kohya, ai-toolkit and OneTrainer write them (lowercased) -> difftune's.
OPTIMIZER_NAMES = {
    "adamw": "adamw", "adam": "adamw", "adamw8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
    "adam8bit": "adamw8bit", "bitsandbytes.optim.adamw8bit": "adamw8bit",
    "prodigy": "prodigy", "prodigyopt.prodigy": "prodigy", "adafactor": "adafactor",
    "transformers.optimization.adafactor": "adafactor", "lion": "lion", "lion8bit": "lion8bit",
    "lion_8bit": "lion8bit", "came": "came", "came_pytorch.came": "came",
    "adamwschedulefree": "schedulefree_adamw", "schedule_free_adamw": "schedulefree_adamw",
    "schedulefree.adamwschedulefree": "schedulefree_adamw", "schedulefree_adamw": "schedulefree_adamw",
}
SCHEDULERS = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
              "cosine": "cosine", "cosine_with_restarts": "cosine"}
DTYPES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "float_16": "fp16",
          "bf16": "bf16", "bfloat16": "bf16", "bfloat_16": "bf16",
          "fp32": "fp32", "float": "fp32", "float32": "fp32", "float_32": "fp32"}
# Suffixes of single-file checkpoints (a pickle one is refused, with how to convert it, at load).
SINGLE_FILES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin")
# A Hugging Face repository name ("owner/name"), which difftune does not download.
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def lookup(table: dict[str, str], what: str, instead: str) -> Any:
    """A converter through `table` (case-insensitive); other values have no equivalent."""
    def convert(value: Any) -> str:
        found = table.get(str(value).lower())
        if found is None:
            raise NoEquivalent(f"difftune has no {what} {value!r}; {instead}")
        return found
    return convert


optimizer = lookup(OPTIMIZER_NAMES, "optimizer", f"choose one of {sorted(OPTIMIZERS)} "
                   "(train.optimizer; difftune's default is adamw)")
scheduler = lookup(SCHEDULERS, "scheduler", "it keeps the constant default (train.scheduler: "
                   "constant, linear or cosine)")
dtype = lookup(DTYPES, "dtype", "it keeps its default")


def number(value: Any) -> float:
    """A number YAML may have read as text (PyYAML reads 1e-4, without a dot, as a string)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NoEquivalent(f"{value!r} is not a number; it keeps difftune's default") from None


def family(t: Translation, name: str, source: str, path: Path, guess: str | None = None) -> None:
    """Set model.family (and model.variant) from the trainer's own name for the model,
    through its table; stop with a clear error for a model difftune does not train."""
    table = TABLES[t.trainer]
    if name not in table:
        raise ConfigError(f"{path}: {source}: a model this importer does not know; pass "
                          f"--family with one of {', '.join(registry.names())}")
    target = table[name]
    if target is None:
        raise ConfigError(f"{path}: {source}: difftune does not train this model; it trains "
                          f"{', '.join(registry.names())}")
    t.put("model.family", target[0], source, guess)
    if target[1] is not None:
        t.put("model.variant", target[1], source, guess)


def local(value: str, base: Path) -> Path:
    """A path as the other trainer would read it: absolute as given; relative ones taken
    against the source file's folder (they were relative to where that trainer ran)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()


def put_path(t: Translation, dst: str, value: Any, source: str, base: Path) -> None:
    """Set a path field, saying when a relative path was resolved (a guess); a download
    address becomes its file name beside the run file, to be downloaded there."""
    if "://" in str(value):
        name = PurePosixPath(urlparse(str(value)).path).name or "model.safetensors"
        t.put(dst, name, source, f"a download address: download it to {name} beside the run "
              "file (difftune reads local files only), or set the path")
        return
    path = local(str(value), base)
    guess = (None if Path(str(value)).expanduser().is_absolute() else
             "relative to the imported file's folder")
    t.put(dst, path.as_posix(), source, guess)


def model_source(t: Translation, value: Any, source: str, base: Path) -> None:
    """The base model: a folder -> model.path, a .safetensors file -> model.transformer,
    a Hugging Face repository name -> model.path to be replaced by the downloaded folder."""
    text = str(value)
    path = local(text, base)
    if "://" in text:
        put_path(t, "model.transformer", text, source, base)
    elif path.is_dir():
        put_path(t, "model.path", text, source, base)
    elif path.is_file() or path.suffix.lower() in SINGLE_FILES:
        put_path(t, "model.transformer", text, source, base)
    elif HUB_NAME.fullmatch(text):
        t.put("model.path", text, source, f"{text!r} is a Hugging Face repository name and "
              "difftune reads local files only: download it (hf download "
              f"{text} --local-dir DIR) and set model.path to that folder")
    else:
        put_path(t, "model.path", text, source, base)


def area_side(width: int, height: int) -> int:
    """The square side (a multiple of 16) of a width x height size's area."""
    return max(64, int(math.sqrt(width * height)) // 16 * 16)


def pair_side(value: Any) -> int:
    """kohya's resolution: 1024, "1024" or a width and height ("1024,768", [1024, 768]); a
    non-square size becomes the side of the same area."""
    sizes = _numbers(value)
    if len(sizes) == 1 or (len(sizes) == 2 and sizes[0] == sizes[1]):
        return sizes[0]
    if len(sizes) != 2:
        raise NoEquivalent(f"{value!r} is no width,height difftune can read; it keeps 1024 "
                           "(datasets.resolution)")
    return area_side(*sizes)


def sides(value: Any) -> int | list[int]:
    """One side or several to train at (ai-toolkit's [512, 768, 1024], OneTrainer's
    "512,768"); OneTrainer's "WxH" becomes the side of the same area."""
    if isinstance(value, str) and "x" in value.lower():
        width, _, height = value.lower().partition("x")
        return area_side(*_numbers(f"{width},{height}"))
    unique = list(dict.fromkeys(_numbers(value)))
    return unique[0] if len(unique) == 1 else unique


def _numbers(value: Any) -> list[int]:
    """The integers of 1024, "1024,768" or [1024, 768]; NoEquivalent for anything else."""
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        out = [int(str(v).strip()) for v in items if str(v).strip()]
    except ValueError:
        out = []
    if not out:
        raise NoEquivalent(f"{value!r} is no resolution difftune can read; it keeps 1024 "
                           "(datasets.resolution)")
    return out


def count_images(folder: Path, recursive: bool) -> int | None:
    """How many images a dataset folder holds now (None when it is not there)."""
    if not folder.is_dir():
        return None
    found = folder.rglob("*") if recursive else folder.glob("*")
    return sum(1 for p in found if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def steps_from_epochs(t: Translation, epochs: int, source: str) -> None:
    """train.steps for `epochs` epochs over the datasets as they are on disk now (a guess:
    difftune counts steps, the other trainer epochs)."""
    per_epoch = 0
    for d in t.data.get("datasets", []):
        for s in d.get("subsets", []):
            if s.get("regularization"):
                continue
            n = count_images(Path(s["path"]), s.get("recursive", True))
            if n is None:
                t.drop(source, "difftune counts steps, not epochs, and the dataset folders "
                       "are not here to count; set train.steps yourself")
                return
            per_epoch += n * int(s.get("repeats", 1))
    batch = int(t.get("train.batch_size", 1)) * int(t.get("train.grad_accum", 1))
    steps = max(1, math.ceil(per_epoch / batch) * int(epochs))
    t.put("train.steps", steps, source, f"{epochs} epochs of {per_epoch} images (repeats "
          f"counted) at {batch} a step, counted in the dataset folders now")


def optimizer_args(t: Translation, args: dict[str, Any], source: str) -> None:
    """An optimizer's own options: the shared ones to train's fields, the rest to
    train.optimizer_args where the chosen optimizer takes them."""
    name = t.get("train.optimizer", "adamw")
    shared = {"weight_decay": "train.weight_decay", "eps": "train.eps"}
    for key, value in args.items():
        where = src(f"{source}.{key}", value)
        if key in shared:
            t.rule(To(shared[key], number), f"{source}.{key}", value)
        elif key == "betas":
            t.rule(To("train.betas", lambda v: [number(b) for b in v]), f"{source}.{key}", value)
        else:
            try:
                parse_args(name, {key: value})
            except ValueError:
                t.drop(where, f"{name} in difftune takes no option {key!r} "
                       "(train.optimizer_args lists what it takes)")
                continue
            t.put(f"train.optimizer_args.{key}", value, where)


def parse_kv(items: Any) -> dict[str, Any]:
    """kohya-style "key=value" strings (network_args, optimizer_args) as a mapping, values
    read as numbers, booleans or comma lists where they look like one."""
    out: dict[str, Any] = {}
    for item in items if isinstance(items, list) else str(items).split():
        key, _, text = str(item).partition("=")
        out[key.strip()] = _scalar(text.strip())
    return out


def _scalar(text: str) -> Any:
    """A "key=value" value: a list for commas, else a bool, int, float or the string."""
    if "," in text:
        return [_scalar(p.strip()) for p in text.split(",")]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip("\"'")


def fit_sides(t: Translation) -> None:
    """A dataset resolution outside difftune's default bucket sides (256 to 2048), where the
    source set no bounds: the bounds widened to hold it (guessed), so the run validates."""
    for d, dataset in enumerate(t.get("datasets", [])):
        res = dataset.get("resolution")
        if res is None:
            continue
        sides = res if isinstance(res, list) else [res]
        low, high = min(256, max(16, min(sides) // 2)), max(2048, max(sides))
        for key, value, default in (("min_side", low, 256), ("max_side", high, 2048)):
            if key not in dataset and value != default:
                t.put(f"datasets.{d}.{key}", value, f"resolution = {res}",
                      f"difftune's default {key} ({default}) would refuse that resolution")


def other_objective(t: Translation) -> None:
    """Train options of the objective the family does not train with (a DDPM noise offset
    for FLUX.1, a timestep distribution for SDXL) taken out again, with a note: difftune
    refuses them rather than ignore them."""
    name = t.get("model.family")
    train = t.data.get("train", {})
    why = f"does not apply to model.family = \"{name}\" (its objective does not use it)"
    for key, default in objectives.other_objective(name).items():
        if key not in train or train[key] == default:
            continue
        del train[key]
        t.comments.pop(f"train.{key}", None)
        mapped = [n for n in t.notes if n.target.startswith(f"train.{key} =")]
        t.notes = [n for n in t.notes if n not in mapped]
        for note in mapped:
            t.drop(note.source, why)


def tables(value: Any, where: str, path: Path) -> list[dict[str, Any]]:
    """A list of tables (datasets, subsets, concepts), or a refusal naming the place."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{path}: {where} should be a list of tables; fix it")
    return value


def fit_schedule(t: Translation) -> None:
    """What difftune refuses as longer than the run (a default 1000-step save interval on a
    short run, OneTrainer's 200 warm-up steps): a warm-up shortened to a tenth of the steps,
    a save interval left out (the end of the run is saved anyway)."""
    steps, warmup = int(t.get("train.steps", 1000)), t.get("train.warmup_steps")
    if isinstance(warmup, int) and warmup >= steps:
        t.put("train.warmup_steps", steps // 10, f"warmup {warmup} >= train.steps {steps}",
              "difftune's warm-up must be shorter than the run: a tenth of it")
    every = t.get("save.every_n_steps")
    if isinstance(every, int) and every > steps:
        del t.data["save"]["every_n_steps"]
        t.comments.pop("save.every_n_steps", None)
        t.drop(f"save.every_n_steps = {every} (imported)", f"longer than the run ({steps} "
               "steps); the end of the run is saved anyway")
