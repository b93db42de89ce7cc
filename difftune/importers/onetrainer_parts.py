"""OneTrainer's nested tables: model parts (weight dtypes, trained or not, layer skips),
concepts (each a difftune subset), samples (the prompt file) and its "every N <unit>"
schedules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from difftune.errors import ConfigError
from difftune.families import registry
from difftune.importers.notes import USED, Drop, NoEquivalent, Rule, To, Translation, src
from difftune.importers.prompts import line, prompts_file
from difftune.importers.values import local, put_path, tables

STORAGE = {"FLOAT_8": "fp8", "BFLOAT_16": "bf16", "FLOAT_16": "fp16", "FLOAT_32": "fp32"}
QUANTIZED = {"NFLOAT_4": "nf4", "INT_8": "int8", "INT_W8A8": "int8", "FLOAT_W8A8": "fp8"}
OFF = (None, False, 0, 0.0, "", [], {})
# TrainConfig's layer skip of each text encoder, by the encoder's position.
LAYER_SKIPS = {"text_encoder_layer_skip": 0, "text_encoder_2_layer_skip": 1,
               "text_encoder_3_layer_skip": 2, "text_encoder_4_layer_skip": 3}


def _dtype(t: Translation, source: str, value: Any, part: str) -> None:
    """A part's weight_dtype: a storage dtype, or a quantization of the frozen weights."""
    field = part.split(":")[0]
    if value in STORAGE:
        t.put(f"precision.{field}", STORAGE[value], source)
    elif value in QUANTIZED and field != "vae":
        t.put(f"precision.quantize.{field}", QUANTIZED[value], source)
    else:
        t.drop(source, f"difftune stores {field} as fp32, bf16, fp16 or fp8, or quantizes it "
               "(precision.quantize); it keeps its default")


def _encoder(t: Translation, part: str) -> str | None:
    """The difftune name of text encoder number N of the family (None past its last)."""
    spec = registry.spec(t.get("model.family"), t.get("model.variant"))
    index = int(part.split(":")[1])
    return spec.encoder_names[index] if index < len(spec.encoder_names) else None


def parts(t: Translation, key: str, value: dict[str, Any], part: str) -> None:
    """One model part's table (transformer, text_encoder_2, vae, ...)."""
    encoder = _encoder(t, part) if part.startswith("text_encoders") else None
    for name, item in value.items():
        source = src(f"{key}.{name}", item)
        if name == "weight_dtype":
            _dtype(t, source, item, part)
        elif name == "train" and encoder and item:
            trained = list(t.get("adapter.text_encoders", []))
            t.put("adapter.text_encoders", trained + [encoder], source)
        elif name == "train":
            t.drop(source, "difftune trains the denoiser, and the text encoders named in "
                   "adapter.text_encoders", builtin=True)
        elif name == "model_name" and item and part == "denoiser":
            put_path(t, "model.transformer", item, source, t.base)
        elif name == "learning_rate" and item and encoder:
            t.put("adapter.text_encoder_lr", item, source)
        elif item in OFF:
            continue
        else:
            t.drop(source, "a per-part setting difftune does not have")


def layer_skips(t: Translation, data: dict[str, Any]) -> None:
    """text_encoder(_N)_layer_skip as model.clip_skip. OneTrainer reads an encoder's
    hidden_states[default - skip] (modules/model/util/clip_util.py), its default being the
    state the model's pipeline reads (SD 1.5's last, normed; SDXL's and SD3's penultimate), as
    model.clip_skip counts from the state the family declares: N stays N (kohya's clip_skip
    counts the last layer as 1). difftune skips alike in every CLIP encoder read at a hidden
    state, and nowhere else."""
    spec = registry.spec(t.get("model.family"), t.get("model.variant"))
    read = [s.is_clip and s.hidden != "none" for s in spec.text_encoders]
    given = {k: data[k] for k in LAYER_SKIPS if k in data}
    clips = {k: int(v or 0) for k, v in given.items()
             if LAYER_SKIPS[k] < len(read) and read[LAYER_SKIPS[k]]}
    for key, value in given.items():
        if key not in clips and value not in OFF:
            t.drop(src(key, value), "difftune skips layers of CLIP encoders read at a hidden "
                   "state only (model.clip_skip); this encoder is read as its pipeline reads it")
    source = ", ".join(src(k, v) for k, v in clips.items())
    if len(set(clips.values())) > 1:
        t.drop(source, "difftune's model.clip_skip skips as many layers in every CLIP encoder; "
               "set it by hand")
    elif any(clips.values()):
        t.put("model.clip_skip", next(iter(clips.values())), source)


def schedule_every(dst: str, count_key: str) -> Any:
    """A rule for `<x>_unit`: with unit STEP, `<x>` steps become `dst`; other units have no
    equivalent (difftune counts steps)."""
    def rule(t: Translation, key: str, value: Any, where: str) -> None:
        count = t.context.get("source", {}).get(count_key)
        source = f"{src(count_key, count)}, {src(key, value)}"
        if value == "STEP" and count:
            t.put(dst, int(count), source)
        elif value == "NEVER" or not count:
            t.drop(source, "off", builtin=True)
        else:
            t.drop(source, f"difftune counts {dst} in steps, not {str(value).lower()}s; set it")
    return rule


IMAGE: dict[str, Rule] = {"enable_random_flip": To("datasets.0.subsets.{}.flip")}
TEXT: dict[str, Rule] = {
    "enable_tag_shuffling": To("datasets.0.subsets.{}.shuffle_caption"),
    "tag_delimiter": To("datasets.0.subsets.{}.caption_separator"),
    "keep_tags_count": To("datasets.0.subsets.{}.keep_tokens"),
    "tag_dropout_probability": To("datasets.0.subsets.{}.caption_tag_dropout_rate"),
    "tag_dropout_enable": USED,
    "prompt_source": To("datasets.0.subsets.{}.caption_ext", lambda v: _source(v)),
}


def _source(value: Any) -> str:
    if value != "sample":
        raise NoEquivalent("difftune reads captions from a text file beside each image "
                           "(prompt_source \"sample\")")
    return ".txt"


def _read_list(t: Translation, data: dict[str, Any], inline: str, file_key: str,
               path: Path) -> list[Any]:
    """A list given inline, else read from the JSON file its `file_key` names."""
    if data.get(inline):
        return tables(data[inline], inline, path)
    if not data.get(file_key):
        return []
    where = local(str(data[file_key]), t.base)
    try:
        found = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        t.drop(f"{file_key} = {data[file_key]!r}", f"{where} is not here to read; add it by hand")
        return []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}: {file_key} {where} cannot be read as JSON ({err})") from None
    return tables(found, f"{file_key} {where}", path)


def concepts(t: Translation, data: dict[str, Any], path: Path) -> None:
    """Each enabled concept one subset of dataset 0 (OneTrainer's resolution is global)."""
    s = 0
    for c in _read_list(t, data, "concepts", "concept_file_name", path):
        name = f"concept {c.get('name') or c.get('path')!r}"
        if not c.get("enabled", True):
            t.drop(f"{name} (disabled)", "left out, as OneTrainer leaves it out")
            continue
        if c.get("type") == "VALIDATION":
            put_path(t, "validation.path", c.get("path", ""), f"{name} type = VALIDATION",
                     t.base)
            continue
        where = f"datasets.0.subsets.{s}"
        put_path(t, f"{where}.path", c.get("path", ""), f"{name} path", t.base)
        t.put(f"{where}.recursive", bool(c.get("include_subdirectories", False)),
              f"{name} include_subdirectories")
        if c.get("type") == "PRIOR_PREDICTION":
            t.put(f"{where}.regularization", True, f"{name} type = PRIOR_PREDICTION",
                  "OneTrainer trains these on the base model's own prediction; difftune "
                  "trains regularization images on their captions")
        _balancing(t, c, name, where)
        if c.get("loss_weight", 1.0) != 1.0:
            t.put(f"{where}.loss_weight", c["loss_weight"], f"{name} loss_weight")
        for table, rules in (("image", IMAGE), ("text", TEXT)):
            given = {k: v for k, v in (c.get(table) or {}).items() if v not in OFF}
            for key, value in given.items():
                t.rule(rules.get(key, Drop("a concept augmentation difftune does not have")),
                       f"{name} {table}.{key}", value, str(s))
        s += 1


def _balancing(t: Translation, concept: dict[str, Any], name: str, where: str) -> None:
    """balancing with strategy REPEATS -> repeats (whole, at least 1)."""
    value = concept.get("balancing", 1.0)
    source = f"{name} balancing = {value}"
    if concept.get("balancing_strategy", "REPEATS") != "REPEATS":
        t.drop(source, "difftune balances by repeats only; set the subset's repeats")
    elif value != 1:
        repeats = max(1, round(float(value)))
        t.put(f"{where}.repeats", repeats, source,
              None if repeats == value else "difftune's repeats are whole numbers")


def samples(t: Translation, data: dict[str, Any], path: Path) -> None:
    """The enabled samples as the lines of the prompt file."""
    for item in _read_list(t, data, "samples", "sample_definition_file_name", path):
        if isinstance(item, dict) and item.get("enabled", True) and item.get("prompt"):
            t.prompts.append(line(str(item["prompt"]), item))
    prompts_file(t, "samples")
