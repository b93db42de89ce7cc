"""Which fields of the form apply to the chosen family, adapter type and options.

Everything here is read from what the code already knows: the family's light spec (its text
encoders, objective, variants, block-swap blocks, conv layers, edit images, refusals: see
`families.specs.FamilySpec`), the objective-only train options `config.checks` refuses for the
other objective, the LoRA options a full fine-tune ignores (`config.full.LORA_ONLY`), the
adapter kinds peft trains (`config.adapter.PEFT_KINDS`), and the switches whose fields the
config checks call ignored or refuse when the switch is off (EMA, regularization, masks, tag
shuffling, sampling prompts, validation, output preservation). A hidden field is never lost:
a value the file sets stays in the TOML, and validation still names it when it conflicts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from difftune.config.adapter import PEFT_KINDS
from difftune.config.objectives import DDPM_ONLY, FLOW_ONLY
from difftune.config.full import LORA_ONLY
from difftune.families import registry
from difftune.families.specs import FamilySpec
from difftune.ui.forms.schema import FieldSpec, fields_by_path

SUB = "datasets[0].subsets[0]."


class Facts:
    """What the rules read: the form's values (defaults filled in) and the family's spec."""

    def __init__(self, values: dict[str, Any], fields: dict[str, FieldSpec]) -> None:
        self.values, self.fields = values, fields
        family = str(self.get("model.family"))
        self.family = family if family in registry.FAMILIES else None
        self.spec = self._spec()

    def _spec(self) -> FamilySpec | None:
        """The chosen variant's spec (the family's default variant when it is not one)."""
        if self.family is None:
            return None
        try:
            return registry.spec(self.family, self.get("model.variant"))
        except Exception:  # an unknown variant: validation names it; show the default's fields
            return registry.spec(self.family)

    def get(self, path: str) -> Any:
        """The value the form holds for `path`, else the field's default."""
        if path in self.values:
            return self.values[path]
        field = self.fields.get(path)
        return field.default if field is not None else None

    @property
    def adapter(self) -> str:
        """The adapter type."""
        return str(self.get("adapter.type"))

    def top_spec(self) -> FamilySpec | None:
        """The family's spec with its variants listed (None for an unknown family)."""
        if self.family is None:
            return None
        return importlib.import_module(registry.FAMILIES[self.family][0]).SPEC


@dataclass(frozen=True)
class Rule:
    """Fields (`paths`) shown only when `when` holds; `why` says what turns them on."""

    paths: tuple[str, ...]
    when: Callable[[Facts], bool]
    why: Callable[[Facts], str]


def _family(f: Facts) -> str:
    return f"model.family = \"{f.family}\""


def _encoders(f: Facts) -> tuple[str, ...]:
    return f.spec.encoder_names if f.spec else ()


def _lora_encoders(f: Facts) -> bool:
    """Whether some text encoder of the family can train (a LoRA, or full weights)."""
    if f.spec is None:
        return True
    refused = {n for n, _ in f.spec.text_encoder_lora_refused}
    return f.adapter == "full" or any(n not in refused for n in f.spec.encoder_names)


def _objective(f: Facts) -> str | None:
    return f.spec.objective if f.spec else None


def _known(f: Facts, test: Callable[[FamilySpec], Any]) -> bool:
    """`test(spec)`, or True for an unknown family (nothing is hidden then)."""
    return True if f.spec is None else bool(test(f.spec))


def _tags(f: Facts) -> bool:
    return bool(f.get(SUB + "shuffle_caption")) or (f.get(SUB + "caption_tag_dropout_rate") or 0) > 0


_SOURCES = ("model.path", "model.transformer", "model.vae", "model.clip_l", "model.t5",
            "model.text_encoder", "model.image_encoder")
_EMA = ("decay", "every_n_steps", "warmup", "cpu", "use_for")
_SAMPLE = ("every_n_steps", "at_start", "at_end", "width", "height", "steps", "guidance", "cfg",
           "seed")
_VALIDATION = ("fraction", "path", "every_n_steps", "timesteps", "seed", "early_stop_patience",
               "min_delta", "keep_best")
_EMBEDDING = ("name", "tokens", "init", "encoders", "kind")

RULES: tuple[Rule, ...] = (
    Rule(("model.variant",), lambda f: f.top_spec() is None or bool(f.top_spec().variants),
         lambda f: f"{_family(f)} has no variants"),
    Rule(_SOURCES, lambda f: f.get("model.flavor") != "tiny",
         lambda f: "model.flavor = \"tiny\" builds the built-in tiny model and needs no files"),
    Rule(("model.clip_l",), lambda f: f.spec is None or "clip_l" in _encoders(f),
         lambda f: f"{_family(f)} has no CLIP-L encoder"),
    Rule(("model.t5", "model.t5_mask"), lambda f: f.spec is None or "t5" in _encoders(f),
         lambda f: f"{_family(f)} has no T5 encoder"),
    Rule(("model.text_encoder",), lambda f: _known(
        f, lambda s: any(e.kind == "decoder" for e in s.text_encoders)),
        lambda f: f"{_family(f)} has no decoder-LLM text encoder"),
    Rule(("model.image_encoder",),
         lambda f: _known(f, lambda s: "image_encoder" in s.files.keys),
         lambda f: f"{_family(f)} has no image encoder"),
    Rule(("model.clip_skip",), lambda f: _known(f, lambda s: s.clip_hidden),
         lambda f: f"{_family(f)} reads no CLIP hidden state (nothing to skip)"),
    Rule(("adapter.train_blocks",), lambda f: f.adapter == "full",
         lambda f: "only adapter.type = \"full\" trains whole blocks"),
    Rule(tuple(f"adapter.{n}" for n in LORA_ONLY if n != "text_encoder_targets"),
         lambda f: f.adapter in PEFT_KINDS,
         lambda f: f"adapter.type = \"{f.adapter}\" trains no LoRA"),
    Rule(("adapter.dropout", "adapter.dora"), lambda f: f.adapter in ("lora", "locon"),
         lambda f: f"a LoRA / LoCon option; adapter.type = \"{f.adapter}\""),
    Rule(("adapter.factor", "adapter.decompose_both", "adapter.full_matrix"),
         lambda f: f.adapter == "lokr", lambda f: "a LoKr option (adapter.type = \"lokr\")"),
    Rule(("adapter.conv_rank", "adapter.conv_alpha"),
         lambda f: f.adapter in ("locon", "loha", "lokr") and _known(f, lambda s: s.conv_targets),
         lambda f: (f"{_family(f)} has no Conv2d layers to adapt" if f.adapter in
                    ("locon", "loha", "lokr") else "LyCORIS kinds only (locon, loha, lokr)")),
    Rule(("adapter.text_encoders", "adapter.text_encoder_lr"),
         lambda f: f.adapter != "embedding" and _lora_encoders(f),
         lambda f: (f"{_family(f)} trains its denoiser only" if f.adapter != "embedding"
                    else "adapter.type = \"embedding\" trains no LoRA")),
    Rule(("adapter.text_encoder_targets",),
         lambda f: f.adapter in PEFT_KINDS and _lora_encoders(f) and
         bool(f.get("adapter.text_encoders")),
         lambda f: "set adapter.text_encoders to train a text-encoder LoRA"),
    Rule(tuple(f"adapter.embeddings[0].{n}" for n in _EMBEDDING) + ("adapter.embedding_lr",),
         lambda f: f.adapter != "full" and _known(f, lambda s: s.embeddings_refused is None),
         lambda f: (f"{_family(f)} cannot train embeddings ({f.spec.embeddings_refused})"
                    if f.spec and f.spec.embeddings_refused else
                    "a full fine-tune trains embeddings in a run of their own")),
    Rule(tuple(f"train.{k}" for k in DDPM_ONLY), lambda f: _objective(f) != "flow",
         lambda f: f"{_family(f)} trains with flow matching (DDPM options)"),
    Rule(tuple(f"train.{k}" for k in FLOW_ONLY), lambda f: _objective(f) != "ddpm",
         lambda f: f"{_family(f)} trains with DDPM (flow-matching options)"),
    Rule(("train.sigmoid_mean", "train.sigmoid_std"),
         lambda f: f.get("train.timesteps") in ("sigmoid", "shift"),
         lambda f: "used by train.timesteps = \"sigmoid\" or \"shift\""),
    Rule(("train.shift",), lambda f: f.get("train.timesteps") == "shift",
         lambda f: "used by train.timesteps = \"shift\""),
    Rule(("train.blocks_to_swap",), lambda f: _known(f, lambda s: s.swap_blocks),
         lambda f: f"{_family(f)} cannot swap blocks"),
    Rule(("train.experts", "train.expert_switch_every", "train.expert_boundary",
          "model.transformer_2"), lambda f: _known(f, lambda s: s.experts),
         lambda f: f"{_family(f)} (variant \"{f.get('model.variant')}\") has one denoiser, "
                   "no experts"),
    Rule(("train.huber_delta", "train.huber_schedule"), lambda f: f.get("train.loss") != "l2",
         lambda f: "used by train.loss = \"huber\" or \"smooth_l1\""),
    Rule(tuple(f"train.ema.{n}" for n in _EMA), lambda f: bool(f.get("train.ema.enabled")),
         lambda f: "turn on train.ema.enabled"),
    Rule((SUB + "control_path",), lambda f: _known(f, lambda s: s.control_images),
         lambda f: f"{_family(f)} trains no edit model"),
    Rule((SUB + "unmasked_weight",),
         lambda f: f.get(SUB + "mask_path") is not None or bool(f.get(SUB + "alpha_mask")),
         lambda f: "needs mask_path or alpha_mask"),
    Rule((SUB + "keep_tokens",), _tags,
         lambda f: "needs shuffle_caption or caption_tag_dropout_rate"),
    Rule((SUB + "token_warmup_min",), lambda f: (f.get(SUB + "token_warmup_steps") or 0) > 0,
         lambda f: "needs token_warmup_steps"),
    Rule((SUB + "caption_separator",),
         lambda f: _tags(f) or (f.get(SUB + "token_warmup_steps") or 0) > 0,
         lambda f: "needs shuffle, tag dropout or token warm-up"),
    Rule((SUB + "class_prompt", SUB + "class_images"),
         lambda f: bool(f.get(SUB + "regularization")),
         lambda f: "class images are regularization images: turn on regularization"),
    Rule((SUB + "class_steps", SUB + "class_guidance"),
         lambda f: bool(f.get(SUB + "regularization")) and (f.get(SUB + "class_images") or 0) > 0,
         lambda f: "used when class_images generates class images"),
    Rule(("cache.dir",), lambda f: "disk" in (f.get("cache.latents"), f.get("cache.text")),
         lambda f: "only disk caches (cache.latents or cache.text = \"disk\") use a folder"),
    Rule(tuple(f"sample.{n}" for n in _SAMPLE), lambda f: bool(f.get("sample.prompts")),
         lambda f: "set sample.prompts to sample"),
    Rule(("save.format",), lambda f: f.adapter in ("lora", "embedding") and
         not f.get("adapter.dora"),
         lambda f: ("a full fine-tune is written as a diffusers folder" if f.adapter == "full"
                    else "LyCORIS kinds and DoRA are written in the LyCORIS layout")),
    Rule(("save.dora_comfyui",), lambda f: f.adapter in ("lora", "locon") and
         bool(f.get("adapter.dora")), lambda f: "a DoRA option: turn on adapter.dora"),
    Rule(("preservation.trigger",), lambda f: f.adapter in PEFT_KINDS,
         lambda f: f"adapter.type = \"{f.adapter}\" has no adapter to switch off"),
    Rule(("preservation.replacement", "preservation.weight"),
         lambda f: f.adapter in PEFT_KINDS and bool(str(f.get("preservation.trigger")).strip()),
         lambda f: "set preservation.trigger to turn output preservation on"),
    Rule(tuple(f"validation.{n}" for n in _VALIDATION),
         lambda f: f.get("validation.enabled") is not False,
         lambda f: "validation.enabled = false"),
)


def hidden(values: dict[str, Any]) -> dict[str, str]:
    """The form's fields that do not apply to `values` (form paths, defaults for the rest),
    each with the reason shown to a user who looks for it."""
    facts = Facts(values, fields_by_path())
    out: dict[str, str] = {}
    for rule in RULES:
        if not rule.when(facts):
            why = rule.why(facts)
            for path in rule.paths:
                out.setdefault(path, why)
    return out


def choices(values: dict[str, Any]) -> dict[str, list[Any]]:
    """Choices that depend on other fields: the family's variants, text encoders and LoRA
    layouts."""
    facts = Facts(values, fields_by_path())
    top = facts.top_spec()
    out: dict[str, list[Any]] = {}
    if top is not None and top.variants:
        out["model.variant"] = [n for n, _ in top.variants]
    if facts.spec is not None:
        out["adapter.text_encoders"] = list(facts.spec.encoder_names)
        out["adapter.embeddings[0].encoders"] = list(facts.spec.encoder_names)
        out["save.format"] = list(facts.spec.formats)
        if facts.spec.experts:
            out["train.experts"] = [e.name for e in facts.spec.experts]
    return out
