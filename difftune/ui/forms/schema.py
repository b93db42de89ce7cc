"""The run form's description, walked from the same pydantic models the CLI validates with.

Every field of `RunConfig` and of its sections becomes one `FieldSpec`: its dotted path as the
CLI names it in messages (`train.lr`, `datasets[0].subsets[0].path`), its kind (which input
the form shows), default, choices (a `Literal`), bounds (`ge`/`gt`/`le`/`lt`, lengths) and help
text (the field's `description`). Nothing is listed by hand: a field added to a model appears
in the form by itself. Lists of tables (`[[datasets]]`, `[[datasets.subsets]]`,
`[[adapter.embeddings]]`) are described by their first item (index 0, `repeated` naming the
list); the form repeats those fields for every item the file holds.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from difftune.config.run import RunConfig
from difftune.families import registry

Kind = Literal["bool", "int", "float", "str", "path", "choice", "list", "table", "value"]
# Field paths whose choices a validator (not a Literal) decides, with where they come from.
DYNAMIC_CHOICES = {"model.family": registry.names}


class FieldSpec(BaseModel):
    """One input of the form."""

    path: str
    name: str
    label: str = ""  # the human label (the dotted key is shown beside it, small)
    kind: Kind
    default: Any = None
    required: bool = False
    nullable: bool = False
    choices: list[Any] | None = None
    bounds: dict[str, Any] = {}
    help: str = ""
    item: str | None = None  # the kind of a list's items
    repeated: str | None = None  # the list of tables this field belongs to (its first item)


class SectionSpec(BaseModel):
    """One section of the run file (a top-level TOML table or array of tables)."""

    name: str
    title: str
    help: str
    fields: list[FieldSpec]


def _args(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (the annotation alone when it is not one)."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _strip(annotation: Any) -> Any:
    """`Annotated[X, ...]` -> X."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _scalar_kind(annotation: Any) -> Kind:
    """The kind of a non-union annotation."""
    annotation = _strip(annotation)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return "choice"
    if origin in (list, tuple):
        return "list"
    if origin is dict:
        return "table"
    simple: dict[Any, Kind] = {bool: "bool", int: "int", float: "float", str: "str",
                               Path: "path"}
    return simple.get(annotation, "value")


def _kind(annotation: Any) -> tuple[Kind, bool, list[Any] | None, str | None]:
    """Kind, nullable, choices and list-item kind of a field's annotation."""
    members = [_strip(a) for a in _args(_strip(annotation))]
    nullable = type(None) in members
    members = [a for a in members if a is not type(None)]
    choices: list[Any] = []
    for member in members:
        if typing.get_origin(member) is Literal:
            choices += list(typing.get_args(member))
        elif member is bool and len(members) > 1:
            choices += [True, False]
    kinds = {_scalar_kind(m) for m in members}
    if len(kinds) == 1:
        kind = kinds.pop()
    elif kinds <= {"choice", "bool"}:
        kind = "choice"
    elif choices:  # a choice or a table of choices (precision.text_encoders)
        kind = "choice"
    else:  # e.g. int | list[int]: written as a TOML value
        kind = "value"
    item = None
    if kind == "list":
        inner = [_strip(a) for a in typing.get_args(members[0])]
        item = _scalar_kind(inner[0]) if inner else "value"
        if item == "choice":
            choices = list(typing.get_args(inner[0]))
    return kind, nullable, choices or None, item


def _bounds(info: FieldInfo) -> dict[str, Any]:
    """The numeric and length bounds a field declares."""
    out: dict[str, Any] = {}
    for meta in info.metadata:
        for attr in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern"):
            value = getattr(meta, attr, None)
            if value is not None:
                out[attr] = value
    return out


def _plain(value: Any) -> Any:
    """A default as JSON: paths as text, tuples as lists, models as dicts."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _default(info: FieldInfo) -> Any:
    """The field's default (None for a required field)."""
    if info.default_factory is not None:
        return _plain(info.default_factory())  # type: ignore[call-arg]
    return None if info.default is PydanticUndefined else _plain(info.default)


def _item_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a `list[Model]` field, or None."""
    annotation = _strip(annotation)
    if typing.get_origin(annotation) is list:
        inner = _strip(typing.get_args(annotation)[0])
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return None


def _sub_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a nested-table field, or None."""
    annotation = _strip(annotation)
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) \
        else None


# Words of field names written differently in a label (abbreviations read aloud as a user says
# them); any other word is kept as it is.
_WORDS = {"lr": "learning rate", "ema": "EMA", "vae": "VAE", "t5": "T5", "te": "text encoder",
          "snr": "SNR", "ti": "textual inversion", "dir": "folder", "sd": "SD", "cfg": "CFG",
          "clip": "CLIP", "clip_l": "CLIP-L", "clip_g": "CLIP-G", "dtype": "data type",
          "llm": "LLM", "nf4": "NF4", "fp8": "FP8", "lycoris": "LyCORIS", "lora": "LoRA",
          "id": "ID", "dora": "DoRA", "comfyui": "ComfyUI", "max": "max.", "min": "min.", "num": "number of", "gc": "GC"}


def label(name: str, info: FieldInfo | None = None) -> str:
    """A field's human label: its pydantic `title` when it declares one, else its key's words
    (`min_snr_gamma` -> "Min. SNR gamma", `lr` -> "Learning rate")."""
    if info is not None and info.title:
        return info.title
    words = [_WORDS.get(w, w) for w in name.split("_")]
    text = " ".join(words)
    return text[0].upper() + text[1:] if text else name


def walk(model: type[BaseModel], prefix: str, repeated: str | None = None) -> list[FieldSpec]:
    """Every leaf field of `model` (nested tables and lists of tables included) under `prefix`."""
    out: list[FieldSpec] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        sub, items = _sub_model(info.annotation), _item_model(info.annotation)
        if sub is not None:
            out += walk(sub, path, repeated)
        elif items is not None:
            out += walk(items, f"{path}[0]", f"{path}")
        else:
            kind, nullable, choices, item = _kind(info.annotation)
            dynamic = DYNAMIC_CHOICES.get(path)
            out.append(FieldSpec(
                path=path, name=name, label=label(name, info), kind="choice" if dynamic else kind,
                default=_default(info), required=info.is_required(), nullable=nullable,
                choices=list(dynamic()) if dynamic else choices, bounds=_bounds(info),
                help=info.description or "", item=item, repeated=repeated))
    return out


def sections(model: type[BaseModel] = RunConfig) -> list[SectionSpec]:
    """The run file's sections, in the models' order, each with its fields."""
    out = []
    for name, info in model.model_fields.items():
        sub = _sub_model(info.annotation) or _item_model(info.annotation)
        if sub is None:
            continue
        prefix = name if _sub_model(info.annotation) else f"{name}[0]"
        repeated = None if _sub_model(info.annotation) else name
        doc = (sub.__doc__ or "").strip()
        out.append(SectionSpec(name=name, title=name.capitalize(), help=doc.split("\n\n")[0],
                               fields=walk(sub, prefix, repeated)))
    return out


def fields_by_path(model: type[BaseModel] = RunConfig) -> dict[str, FieldSpec]:
    """Every field of the form by its dotted path."""
    return {f.path: f for s in sections(model) for f in s.fields}


def template(path: str) -> str:
    """A concrete path with its list indices set to 0 (`datasets[2].path` -> `datasets[0].path`),
    the form of the paths `sections` describes."""
    import re

    return re.sub(r"\[\d+\]", "[0]", path)


def inner_lists(path: str) -> list[str]:
    """The lists of tables directly inside the items of list `path` (template paths:
    `datasets` -> [`datasets[0].subsets`])."""
    inner = {f.repeated for f in fields_by_path().values()
             if f.repeated and f.repeated.startswith(path + "[0].")}
    return sorted(r for r in inner if not any(r.startswith(o + "[0].") for o in inner))
