"""Light facts about model families: the types `spec.py` modules fill in, importing no torch.

Config validation and the CLI need to know a family's text encoders, objective, refusals and
defaults before anything heavy is imported; the family classes read the same facts from here,
so there is one place each fact is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TextEncoderSpec:
    """What a family needs from one text encoder, declared rather than sniffed.

    `kind` picks the transformers model class ("decoder": a decoder LLM such as Qwen3, read
    through its hidden states); `hidden` says which hidden state the denoiser reads ("last",
    "penultimate", or "none" when only the pooled output is used); `pooled` whether the
    pooled/projected output is used; `mask` whether the attention mask is applied.
    `chat` wraps each caption as one user message in the tokenizer's chat template, with these
    template options (None: the caption is tokenized as it is); `trim` keeps only the tokens the
    mask marks (variable-length outputs: cache entries hold the caption's own tokens, batches
    are padded back with a mask, see `families.base.pad_cat`).
    `template` is a format string with `{}` for the caption, used instead of a chat template
    (the pipeline's own fixed prompt); `drop` leading tokens are dropped after the mask trim
    (a template's prefix the pipeline removes); `layers` reads these `hidden_states` indices
    instead of `hidden` (one index: that state; several: concatenated along the features);
    `pad` pads a batch to the spec's `max_length` ("max_length") or to its longest text
    ("longest", with `max_length` as the truncation limit), as the family's pipeline does.
    """

    name: str
    kind: Literal["clip", "clip_projection", "t5", "decoder"]
    max_length: int
    hidden: Literal["last", "penultimate", "none"]
    pooled: bool
    mask: bool = False
    chat: tuple[tuple[str, bool], ...] | None = None
    trim: bool = False
    template: str | None = None
    drop: int = 0
    layers: tuple[int, ...] = ()
    pad: Literal["max_length", "longest"] = "max_length"

    def key_fields(self) -> dict[str, object]:
        """The fields that decide this encoder's output, for cache keys. The decoder-LLM fields
        (`chat`, `trim`, `template`, `drop`, `layers`, `pad`) enter only when set, so the keys
        of encoders without them (and the caches written before those fields existed) stay as
        they were."""
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        for name in DECODER_FIELDS:
            if fields[name] == self.__dataclass_fields__[name].default:
                del fields[name]
        return fields

    @property
    def is_clip(self) -> bool:
        """Whether this is a CLIP encoder (BOS first, clip_skip meaningful)."""
        return self.kind in CLIP_KINDS


@dataclass(frozen=True)
class FamilySpec:
    """Everything about a family that is plain data (see `families.base.Family` for meanings).

    `objective` is "flow" (rectified flow) or "ddpm"; `kohya_text_encoders_refused` says why a
    kohya-format file cannot hold its text-encoder LoRA (None: it can); `denoiser_part` is the
    pipeline's name for the denoiser ("transformer", "unet") and `encoder_parts` gives, per text
    encoder, its pipeline component and tokenizer names; `pipeline_class` is the diffusers pipeline
that samples it; `text_encoder_lora_refused` names the encoders whose LoRA no reader of the
family's files would load, with the reason.
    """

    name: str
    text_encoders: tuple[TextEncoderSpec, ...]
    objective: Literal["flow", "ddpm"]
    kohya_text_encoders_refused: str | None
    bucket_step: int
    denoiser_prefix: str
    default_cfg: float
    default_format: str
    text_encoder_prefixes: dict[str, str]
    keep_high: dict[str, tuple[str, ...]]
    swap_blocks: tuple[str, ...]
    compile_blocks: tuple[str, ...]
    denoiser_part: str
    encoder_parts: tuple[tuple[str, str, str], ...]
    pipeline_class: str
    # Text encoders that cannot get a LoRA, with the reason: ((name, why), ...); refused when
    # the config loads.
    text_encoder_lora_refused: tuple[tuple[str, str], ...] = ()
    # Why textual-inversion embeddings cannot be trained (None: they can); refused at load.
    embeddings_refused: str | None = None
    # How many control/reference images an edit pair may give the family (0: it trains no
    # edit model, and a dataset's `control_path` is refused at load).
    control_images: int = 0

    @property
    def encoder_names(self) -> tuple[str, ...]:
        """The text encoders' names, in declaration order."""
        return tuple(s.name for s in self.text_encoders)

    @property
    def clip_hidden(self) -> bool:
        """Whether a CLIP hidden state reaches the denoiser (where clip_skip means something)."""
        return any(s.is_clip and s.hidden != "none" for s in self.text_encoders)


CLIP_KINDS = ("clip", "clip_projection")
# TextEncoderSpec fields that enter cache keys only when they differ from their defaults.
DECODER_FIELDS = ("chat", "trim", "template", "drop", "layers", "pad")
# Kept out of fp8 storage and quantization in every family's autoencoder.
VAE_KEEP_HIGH = (r"conv_in$", r"conv_out$", r"quant_conv$")
# T5's feed-forward output casts its input to `wo`'s stored dtype (fp8 would break it).
T5_KEEP_HIGH = (r"embeddings", r"embed_tokens", r"^shared$", r"text_projection", r"\.wo$")
