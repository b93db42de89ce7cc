""""Did you mean ...?" for unknown config keys: a misspelt key (`[trian]`, `lerning_rate`) or
another trainer's name for one of ours (`learning_rate`) is named with the key difftune reads.

Candidates come from the pydantic models themselves (field names and their validation
aliases), so a new field is suggested without touching this file; only the names other
trainers use for the same setting are listed here, because no spelling distance finds them.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from pydantic import AliasChoices, BaseModel

# Other trainers' names (kohya sd-scripts, diffusers' scripts, ai-toolkit, OneTrainer) for a
# difftune key, as the dotted path of the field difftune reads.
OTHER_NAMES: dict[str, str] = {
    "learning_rate": "train.lr", "unet_lr": "train.lr",
    "max_train_steps": "train.steps", "num_train_steps": "train.steps",
    "train_batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.grad_accum",
    "lr_scheduler": "train.scheduler", "lr_warmup_steps": "train.warmup_steps",
    "max_grad_norm": "train.max_grad_norm", "optimizer_type": "train.optimizer",
    "network_dim": "adapter.rank", "linear": "adapter.rank", "lora_rank": "adapter.rank",
    "network_alpha": "adapter.alpha", "linear_alpha": "adapter.alpha",
    "lora_alpha": "adapter.alpha", "network_dropout": "adapter.dropout",
    "output_dir": "save.dir", "output_name": "save.name", "save_every_n_steps": "save.every_n_steps",
    "train_data_dir": "path under [[datasets]]", "num_repeats": "repeats under [[datasets]]",
    "pretrained_model_name_or_path": "model.path", "mixed_precision": "precision.mixed",
    "sample_prompts": "sample.prompts", "sample_every_n_steps": "sample.every_n_steps",
}


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field's annotation holds (through list[...], X | None, Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin is None or origin is typing.Literal:
        return None
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def _is_list(annotation: Any) -> bool:
    """Whether a field holds a list (written as [[name]] tables in TOML)."""
    if typing.get_origin(annotation) is list:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_is_list(arg) for arg in typing.get_args(annotation))
    return False


def _section_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that holds the key at the end of `loc` (list indexes and union tags skipped)."""
    model: type[BaseModel] | None = root
    for part in loc[:-1]:
        if isinstance(part, int) or str(part).startswith(("function-", "tagged-union")):
            continue
        field = model.model_fields.get(str(part)) if model else None
        model = model_in(field.annotation) if field else None
        if model is None:
            return None
    return model


def keys_of(model: type[BaseModel]) -> dict[str, str]:
    """Every key `model` accepts (field names and validation aliases) -> the field's name;
    with the keys of the model its shorthand stands for (a dataset's one-folder subset)."""
    shorthand = getattr(model, "shorthand_of", None)
    names = keys_of(shorthand) if shorthand is not None else {}
    for name, field in model.model_fields.items():
        names[name] = name
        alias = field.validation_alias
        for choice in alias.choices if isinstance(alias, AliasChoices) else [alias]:
            if isinstance(choice, str):
                names[choice] = name
    return names


def _written(model: type[BaseModel], name: str, prefix: str) -> str:
    """How a suggested key is written: `[train]` / `[[datasets]]` for a top-level table,
    else its dotted path."""
    field = model.model_fields.get(name)
    if field is None:  # a key of the shorthand's model
        return f"{prefix}.{name}" if prefix else name
    if not prefix and model_in(field.annotation) is not None:
        return f"[[{name}]]" if _is_list(field.annotation) else f"[{name}]"
    return f"{prefix}.{name}" if prefix else name


def _closest(key: str, names: list[str]) -> list[str]:
    """The one or two names nearest `key` (difflib, cutoff 0.6); a second only when it is
    about as near as the first, so a clear typo gets one answer ("repaets": repeats, not
    also frames)."""
    close = difflib.get_close_matches(key, names, n=2, cutoff=0.6)
    score = [difflib.SequenceMatcher(None, key, c).ratio() for c in close]
    return close[:1] + [c for c, r in zip(close[1:], score[1:]) if r >= score[0] - 0.1]


def did_you_mean(root: type[BaseModel], loc: tuple[Any, ...], prefix: str) -> str | None:
    """A suggestion for the unknown key at `loc` ("did you mean train.lr?"), or None.

    `prefix` is the dotted path of the section holding the key, as the error shows it."""
    key = str(loc[-1])
    model = _section_at(root, loc)
    if key.lower() in OTHER_NAMES:
        return f"did you mean {OTHER_NAMES[key.lower()]}?"
    if model is None:
        return None
    names = keys_of(model)
    close = _closest(key.lower(), list(names))
    if close:
        words = " or ".join(_written(model, names[c], prefix) for c in close)
        return f"did you mean {words}?"
    if model is root:
        return None
    # The right key in the wrong section (e.g. `rank` under [train]): name its section.
    homes = [f"{section}.{key}" for section, field in root.model_fields.items()
             if (sub := model_in(field.annotation)) is not None and key in sub.model_fields]
    return f"did you mean {' or '.join(homes)}? (it belongs to another section)" if homes else None
