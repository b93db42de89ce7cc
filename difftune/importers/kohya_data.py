"""kohya sd-scripts datasets: its dataset config (`[general]`, `[[datasets]]`,
`[[datasets.subsets]]`, options inherited downwards) or a `train_data_dir` of "N_class tokens"
folders, as difftune datasets and subsets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from difftune.importers.notes import Drop, Rule, To, Translation, src
from difftune.errors import ConfigError
from difftune.importers.values import pair_side, put_path, tables

SUBSET = "datasets.{}"  # "{}" becomes "<dataset>.subsets.<subset>"


def _crop(random: Any) -> str:
    return "random" if random else "center"


def _path(dst: str) -> Any:
    """A rule writing a path field (relative ones resolved against the source's folder)."""
    def rule(t: Translation, key: str, value: Any, where: str) -> None:
        put_path(t, dst.replace("{}", where), value, src(key, value), t.base)
    return rule


SUBSET_RULES: dict[str, Rule] = {
    "image_dir": _path(SUBSET + ".path"),
    "num_repeats": To(SUBSET + ".repeats"),
    "caption_extension": To(SUBSET + ".caption_ext"),
    "caption_extention": To(SUBSET + ".caption_ext"),
    "class_tokens": To(SUBSET + ".default_caption", guess="kohya uses class_tokens as the "
                       "caption of images without a caption file, as default_caption does"),
    "is_reg": To(SUBSET + ".regularization"),
    "shuffle_caption": To(SUBSET + ".shuffle_caption"),
    "keep_tokens": To(SUBSET + ".keep_tokens"),
    "flip_aug": To(SUBSET + ".flip"),
    "random_crop": To(SUBSET + ".crop", _crop),
    "caption_prefix": To(SUBSET + ".caption_prefix"),
    "caption_suffix": To(SUBSET + ".caption_suffix"),
    "caption_separator": To(SUBSET + ".caption_separator"),
    "enable_wildcard": To(SUBSET + ".wildcards"),
    "caption_dropout_rate": To(SUBSET + ".caption_dropout_rate"),
    "caption_tag_dropout_rate": To(SUBSET + ".caption_tag_dropout_rate"),
    "token_warmup_min": To(SUBSET + ".token_warmup_min"),
    "token_warmup_step": To(SUBSET + ".token_warmup_steps"),
    "alpha_mask": To(SUBSET + ".alpha_mask"),
    "conditioning_data_dir": _path(SUBSET + ".mask_path"),
    "color_aug": Drop("difftune has no colour augmentation"),
    "face_crop_aug_range": Drop("difftune has no face-crop augmentation"),
    "keep_tokens_separator": Drop("difftune keeps the first keep_tokens tags instead"),
    "secondary_separator": Drop("difftune splits tags at caption_separator only"),
    "caption_dropout_every_n_epochs": Drop("difftune drops captions per sample "
                                           "(caption_dropout_rate) only"),
    "cache_info": Drop("difftune scans the folder each run; its caches are content-keyed",
                       builtin=True),
    "metadata_file": Drop("difftune reads captions from files beside the images; write the "
                          "metadata's captions out as .txt files"),
    "resize_interpolation": Drop("difftune resizes with Lanczos", builtin=True),
}
DATASET_RULES: dict[str, Rule] = {
    "resolution": To("datasets.{}.resolution", pair_side),
    "enable_bucket": To("datasets.{}.buckets"),
    "min_bucket_reso": To("datasets.{}.min_side"),
    "max_bucket_reso": To("datasets.{}.max_side"),
    "bucket_reso_steps": To("datasets.{}.bucket_step"),
    "bucket_no_upscale": Drop("difftune's buckets may upscale a small image"),
    "batch_size": To("train.batch_size"),
}


def from_config(t: Translation, config: dict[str, Any], args: dict[str, Any],
                path: Path) -> None:
    """A kohya dataset config: each subset with the options of its dataset, of [general] and of
    the training arguments under it (the nearest wins, as in kohya)."""
    general = config.get("general", {})
    if not isinstance(general, dict):
        raise ConfigError(f"{path}: [general] should be a table; fix it")
    for d, dataset in enumerate(tables(config.get("datasets"), "[[datasets]]", path)):
        own = {k: v for k, v in dataset.items() if k != "subsets"}
        levels = [("", args), ("[general] ", general), (f"datasets[{d}].", own)]
        for s, subset in enumerate(tables(dataset.get("subsets"), f"datasets[{d}].subsets",
                                          path)):
            merged: dict[str, tuple[str, Any]] = {}
            for prefix, values in levels + [(f"datasets[{d}].subsets[{s}].", subset)]:
                merged.update({k: (prefix + k, v) for k, v in values.items()
                               if k in SUBSET_RULES or k == "prior_loss_weight"})
            _subset(t, f"{d}.subsets.{s}", merged)
        for prefix, values in levels:
            for key, value in values.items():
                if key in DATASET_RULES:
                    t.rule(DATASET_RULES[key], prefix + key, value, str(d))
    for key in config:
        if key not in ("general", "datasets"):
            t.unknown(f"{key} (dataset config)")


def _subset(t: Translation, where: str, merged: dict[str, tuple[str, Any]]) -> None:
    """One subset's options; a regularization subset takes prior_loss_weight as its weight."""
    for key, (source, value) in merged.items():
        if key == "prior_loss_weight":
            if merged.get("is_reg", ("", False))[1]:
                t.put(f"datasets.{where}.loss_weight", value, src(source, value))
            continue
        t.rule(SUBSET_RULES[key], source, value, where)


# kohya's DreamBooth folders: "<repeats>_<class tokens>".
FOLDER = re.compile(r"(\d+)_(.*)")


def from_folders(t: Translation, args: dict[str, Any], key: str, regularization: bool) -> None:
    """`train_data_dir` / `reg_data_dir`: each "N_class tokens" folder one subset of dataset 0
    with N repeats and the class tokens as the default caption."""
    root = Path(args[key]).expanduser()
    root = root if root.is_absolute() else (t.base / root).resolve()
    source = src(key, args[key])
    if not root.is_dir():
        t.drop(source, f"{root} is not here to list its \"N_class\" folders; add "
               "[[datasets.subsets]] for each one (path, repeats, default_caption)")
        return
    first = len(t.get("datasets.0.subsets", []))
    folders = sorted(p for p in root.iterdir() if p.is_dir() and FOLDER.fullmatch(p.name))
    for i, folder in enumerate(folders, start=first):
        repeats, tokens = FOLDER.fullmatch(folder.name).groups()  # type: ignore[union-attr]
        where = f"datasets.0.subsets.{i}"
        why = f"kohya's folder name {folder.name!r}: {repeats} repeats, {tokens!r} the caption " \
              "of images without a caption file"
        t.put(f"{where}.path", folder.as_posix(), source, why)
        t.put(f"{where}.repeats", int(repeats), source, why)
        t.put(f"{where}.default_caption", tokens, source, why)
        if regularization:
            t.put(f"{where}.regularization", True, source, "a reg_data_dir folder")
    if not folders:
        t.drop(source, "no \"N_class tokens\" folders in it; add [[datasets.subsets]] yourself")


def subset_args(t: Translation, args: dict[str, Any]) -> None:
    """Training arguments that set every subset's and dataset's options (no dataset config)."""
    for d, dataset in enumerate(t.get("datasets", [])):
        for s in range(len(dataset.get("subsets", []))):
            for key, value in args.items():
                if key in SUBSET_RULES and key not in ("image_dir", "conditioning_data_dir"):
                    t.rule(SUBSET_RULES[key], key, value, f"{d}.subsets.{s}")
        for key, value in args.items():
            if key in DATASET_RULES:
                t.rule(DATASET_RULES[key], key, value, str(d))

