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
    `template` is a format string (`{}` for the caption) used instead of a chat template;
    `suffix` is text tokenized on its own and appended after the padded caption (so padding
    sits between them and `max_length` counts the output, suffix included); `drop` leading
    tokens are removed from the outputs; `layers` are the `hidden_states` indices read (instead
    of `hidden`), stacked as `stack` says ("axis": a new axis after the sequence, (batch, seq,
    layers, dim)); `valid_positions` > 0 passes position ids that count only the masked tokens
    (padding takes no position), repeated over that many rotary axes (3 for Qwen-VL's mRoPE).
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
    suffix: str | None = None
    drop: int = 0
    layers: tuple[int, ...] = ()
    stack: Literal["features", "axis"] = "features"
    valid_positions: int = 0

    def key_fields(self) -> dict[str, object]:
        """The fields that decide this encoder's output, for cache keys. The decoder-LLM fields
        (`chat`, `trim`, `template`, ...) enter only when set, so the keys of encoders without
        them (and the caches written before those fields existed) stay as they were."""
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

    @property
    def encoder_names(self) -> tuple[str, ...]:
        """The text encoders' names, in declaration order."""
        return tuple(s.name for s in self.text_encoders)

    @property
    def clip_hidden(self) -> bool:
        """Whether a CLIP hidden state reaches the denoiser (where clip_skip means something)."""
        return any(s.is_clip and s.hidden != "none" for s in self.text_encoders)


CLIP_KINDS = ("clip", "clip_projection")
# TextEncoderSpec fields that enter cache keys only when set (see `key_fields`).
DECODER_FIELDS = ("chat", "trim", "template", "suffix", "drop", "layers", "stack",
                  "valid_positions")
# Kept out of fp8 storage and quantization in every family's autoencoder.
VAE_KEEP_HIGH = (r"conv_in$", r"conv_out$", r"quant_conv$")
# T5's feed-forward output casts its input to `wo`'s stored dtype (fp8 would break it).
T5_KEEP_HIGH = (r"embeddings", r"embed_tokens", r"^shared$", r"text_projection", r"\.wo$")
