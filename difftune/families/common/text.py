"""Text encoders of any kind, driven by their declared `TextEncoderSpec`.

Only transformers' public API is used: the tokenizer call, the model's forward with
`output_hidden_states`, and its output fields. Nothing probes model internals by attribute
name, so CLIP, CLIP-with-projection and T5 go through the same two functions.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from typing import Any

import torch

from difftune.adapters.formats import CLIP_ROOT
from difftune.families.base import Components, Family, pad_cat
from difftune.families.specs import TextEncoderSpec


def module_device(module: torch.nn.Module) -> torch.device:
    """The device of a module's first parameter (cpu for a module without parameters)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def clip_root(model: torch.nn.Module) -> str:
    """`CLIP_ROOT` or `""`: where a CLIP model's layers sit in its own module tree.

    transformers 5 flattened CLIPTextModel (layers at `encoder.layers.N`) but not
    CLIPTextModelWithProjection (`text_model.encoder.layers.N`). Found through the public
    `get_input_embeddings()`: the root is whatever precedes its `embeddings.token_embedding`.
    """
    embeddings = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is embeddings)
    return name.removesuffix("embeddings.token_embedding")


def clip_final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """A CLIP text model's final layer norm (under its root, see `clip_root`): what its last
    hidden state passes through, and what a CLIP read at its last state with layers skipped
    applies to the earlier state, as diffusers' StableDiffusionPipeline does for clip_skip."""
    return model.get_submodule(clip_root(model) + "final_layer_norm")


def clip_prefixes(family: Family) -> list[str]:
    """The LoRA key prefixes (`text_encoder`, ...) of the family's CLIP encoders (not T5)."""
    return [family.text_encoder_prefixes[s.name] for s in family.text_encoders if s.is_clip]


def file_clip_roots(family: Family) -> dict[str, str]:
    """{CLIP prefix: `CLIP_ROOT`}: the naming LoRA files use, whatever the live model's."""
    return {prefix: CLIP_ROOT for prefix in clip_prefixes(family)}


def model_clip_roots(family: Family, c: Components) -> dict[str, str]:
    """{CLIP prefix: root} of the loaded CLIP encoders: the naming their parameters use."""
    return {family.text_encoder_prefixes[s.name]: clip_root(c.text_encoders[s.name])
            for s in family.text_encoders
            if s.is_clip and c.text_encoders.get(s.name) is not None}


def cleaned(text: str) -> str:
    """A caption as diffusers' `prompt_clean` leaves it (Wan's pipelines): ftfy's fixes where
    ftfy is installed, HTML entities unescaped twice, whitespace runs as one space, stripped."""
    from diffusers.utils import is_ftfy_available

    if is_ftfy_available():
        import ftfy

        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def _stripped(spec: TextEncoderSpec, text: str) -> str:
    """`text` without the spec's `strip` substrings (tidied first where the spec says
    `clean`)."""
    if spec.clean:
        text = cleaned(text)
    for part in spec.strip:
        text = text.replace(part, "")
    return text


def chat_texts(spec: TextEncoderSpec, tokenizer: Any, texts: list[str]) -> list[str]:
    """Each text put in the spec's fixed `template` (a format string), or as one user message
    in the tokenizer's chat template (with the spec's template options, e.g. enable_thinking,
    its system message before it, and its content as typed text parts where the spec says so)
    when the spec declares a chat; else the texts as they are. The spec's `strip` substrings
    are removed from each text first."""
    texts = [_stripped(spec, t) for t in texts]
    if spec.empty is not None:
        texts = [t or spec.empty for t in texts]
    if spec.template is not None:
        return [spec.template.replace("{}", t, 1) for t in texts]
    if spec.chat is None:
        return list(texts)

    def content(text: str) -> Any:
        return [{"type": "text", "text": text}] if spec.parts else text

    head = [{"role": "system", "content": content(spec.system)}] if spec.system is not None else []
    options = {"add_generation_prompt": True, **dict(spec.chat)}
    return [tokenizer.apply_chat_template(
                head + [{"role": "user", "content": content(t)}], tokenize=False,
                **options)
            for t in texts]


def trimmed(out: dict[str, torch.Tensor], drop: int = 0) -> dict[str, torch.Tensor]:
    """Outputs cut to the positions some row's mask marks (all of a batch of one's padding
    goes), the padding still left in longer batches zeroed: a batch then equals its captions'
    cache entries padded by `pad_cat`. Sequence tensors are those as long as the mask. The
    first `drop` positions go too (a template prefix every row has: tokenizers pad on the
    right, or `to_front` moved a left-padded batch's tokens there, so each row's own tokens
    start at position 0)."""
    mask = out["mask"].bool()
    keep = mask.any(0)
    keep[:drop] = False
    length = mask.shape[1]

    valid = mask[:, keep]

    def cut(key: str, v: torch.Tensor) -> torch.Tensor:
        if key == "mask":
            return v[:, keep]
        if v.dim() < 2 or v.shape[1] != length:
            return v
        return v[:, keep] * valid.reshape(*valid.shape, *([1] * (v.dim() - 2))).to(v.dtype)

    return {k: cut(k, v) for k, v in out.items()}


def tokenize(tokenizer: Any, texts: list[str], max_length: int, pad: str = "max_length",
             specials: bool = True, window: int = 0, side: str = "right"
             ) -> dict[str, torch.Tensor]:
    """Pad/truncate every text to `max_length` tokens (or pad to the longest text with `pad`
    "longest"), as the pipelines do at inference (`specials`: whether the tokenizer adds its
    own special tokens; `side`: the side padding goes on); with `window` > 0, to the longest
    text rounded up to a multiple of `window` tokens, at most `max_length` (`windowed`)."""
    extra: dict[str, Any] = {} if specials else {"add_special_tokens": False}
    if window:
        max_length, pad = windowed(tokenizer, texts, max_length, window, extra), "max_length"
    if side != "right":
        extra["padding_side"] = side
    enc = tokenizer(
        texts,
        padding="longest" if pad == "each" else pad,
        max_length=max_length,
        truncation=True,
        return_tensors="pt",
        **extra,
    )
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if ids.shape[-1] == 0:
        # Empty captions through a tokenizer that adds no special tokens (Qwen3's, untemplated)
        # give no position at all, which no model can run on: one masked position of id 0, as
        # AnimaTextEncoderStep substitutes.
        ids, mask = ids.new_zeros(ids.shape[0], 1), mask.new_zeros(mask.shape[0], 1)
    return {"input_ids": ids, "attention_mask": mask}


def windowed(tokenizer: Any, texts: list[str], max_length: int, window: int,
             extra: dict[str, Any]) -> int:
    """The longest text's token count (truncated at `max_length`) rounded up to a multiple of
    `window`, at most `max_length`: the window a pipeline that pads each prompt to a multiple
    of `window` gives it (FLUX.3's text encoder step, 80 tokens)."""
    longest = max(len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length,
                                                **extra)["input_ids"])
    return min(-(-longest // window) * window, max_length)


def spec_tokens(spec: TextEncoderSpec, tokenizer: Any, texts: list[str], max_length: int
                ) -> dict[str, torch.Tensor]:
    """The token ids and mask an encoder reads: the (templated) texts padded to `max_length`,
    or, with a `suffix`, padded to `max_length + drop` less the suffix's tokens and followed by
    the suffix tokenized on its own (padding in between, as pipelines that pad the caption
    before the assistant turn do), so `max_length` tokens remain after the drop."""
    texts = chat_texts(spec, tokenizer, texts)
    if spec.suffix is None:
        return tokenize(tokenizer, texts, max_length, spec.pad, spec.specials, spec.window,
                        spec.side)
    tail = tokenizer([spec.suffix] * len(texts), return_tensors="pt")
    body = tokenize(tokenizer, texts, max_length + spec.drop - tail["input_ids"].shape[1],
                    spec.pad, spec.specials)
    return {k: torch.cat([body[k], tail[k]], dim=1) for k in ("input_ids", "attention_mask")}


def to_front(out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Outputs of a left-padded batch with each row's masked tokens moved to its front, in
    order (sequence tensors: as long as the mask), so `trimmed` reads them as right-padded."""
    mask = out["mask"].bool()
    # A stable sort on "is padding" keeps the tokens' order and puts the padding last.
    order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)

    def move(v: torch.Tensor) -> torch.Tensor:
        if v.dim() < 2 or v.shape[1] != mask.shape[1]:
            return v
        index = order.reshape(*order.shape, *([1] * (v.dim() - 2))).expand_as(v)
        return torch.gather(v, 1, index.to(v.device))

    return {k: move(v) for k, v in out.items()}


def valid_positions(mask: torch.Tensor, axes: int) -> torch.Tensor:
    """Position ids that count only the masked tokens (padding takes no position; leading
    padding sits at 0), repeated over `axes` rotary axes: (axes, batch, length)."""
    positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
    return positions.unsqueeze(0).expand(axes, -1, -1)


def hidden_of(spec: TextEncoderSpec, out: Any, index: int, want_states: bool) -> torch.Tensor:
    """The hidden state the spec reads: its `layers` stacked (on a new axis after the sequence,
    or concatenated along the features), else the one at `index` (or the last state)."""
    if spec.layers:
        states = [out.hidden_states[i] for i in spec.layers]
        return torch.stack(states, dim=2) if spec.stack == "axis" else torch.cat(states, dim=-1)
    return out.hidden_states[index] if want_states else out.last_hidden_state


def dropped(out: dict[str, torch.Tensor], drop: int) -> dict[str, torch.Tensor]:
    """Outputs without their first `drop` positions (sequence tensors: as long as the mask)."""
    if drop == 0:
        return out
    length = out["mask"].shape[1] if "mask" in out else out["hidden"].shape[1]
    return {k: v[:, drop:] if v.dim() >= 2 and v.shape[1] == length else v
            for k, v in out.items()}


@dataclass(frozen=True)
class EncodeOptions:
    """Run-level choices that change an encoder's output (and so belong in its cache key).

    `t5_mask` applies the attention mask in T5 encoders (CLIP encoders keep their declared
    behaviour); `clip_skip` moves a CLIP encoder's hidden state that many layers further from
    the output than the spec declares (0 = as declared), as the diffusers pipelines do.
    """

    t5_mask: bool = False
    clip_skip: int = 0

    def mask_for(self, spec: TextEncoderSpec) -> bool:
        """Whether the attention mask is applied for this encoder."""
        return spec.mask or (self.t5_mask and spec.kind == "t5")

    def skip_for(self, spec: TextEncoderSpec) -> int:
        """Extra layers skipped for this encoder (CLIP hidden states only)."""
        return self.clip_skip if spec.is_clip and spec.hidden != "none" else 0


def max_length(spec: TextEncoderSpec, extras: dict[str, Any]) -> int:
    """The spec's max length, unless the loaded model declares its own (`extras["max_length"]`)."""
    return int(extras.get("max_length", {}).get(spec.name, spec.max_length))


def encode(
    spec: TextEncoderSpec,
    model: torch.nn.Module,
    tokenizer: Any,
    texts: list[str],
    max_length: int,
    mask: bool | None = None,
    clip_skip: int = 0,
) -> dict[str, torch.Tensor]:
    """Encode texts with one encoder; returns "hidden" and/or "pooled" (and "mask" if used).

    `hidden` is the last or penultimate hidden state as the spec declares, `clip_skip` layers
    further back; `pooled` is the model's pooled (CLIP) or projected (CLIP with projection)
    output. `mask` overrides the spec's mask flag when given. A chat spec wraps the texts in
    the chat template first (`spec_tokens`: template, suffix); a trimming spec returns only the
    masked positions (`trimmed`), then `drop` leading positions go (`dropped`).
    Gradients follow the caller's grad mode, so a trained encoder can run here with autograd on.
    A spec that pads "each" encodes the texts one by one and pads the outputs (`pad_cat`).
    """
    if (spec.pad == "each" or spec.window) and len(texts) > 1:
        # Each text on its own (a window-sizing pipeline, FLUX.3's, and ERNIE-Image's encode one
        # prompt a call), zero-padded to the longest (`pad_cat`).
        return pad_cat([encode(spec, model, tokenizer, [t], max_length, mask, clip_skip)
                        for t in texts])
    tokens = spec_tokens(spec, tokenizer, texts, max_length)
    device = module_device(model)
    ids = tokens["input_ids"].to(device)
    attention = tokens["attention_mask"].to(device)
    use_mask = spec.mask if mask is None else mask
    # hidden_states[-1] is the last layer before any final norm; "last" reads the normed output,
    # and with layers skipped (as in diffusers) the earlier state, normed likewise for a CLIP.
    index = {"last": -1, "penultimate": -2, "none": -1}[spec.hidden] - clip_skip
    want_states = (spec.hidden == "penultimate" or (spec.hidden == "last" and clip_skip > 0)
                   or bool(spec.layers))
    kwargs: dict[str, Any] = {"output_hidden_states": want_states}
    if use_mask:
        kwargs["attention_mask"] = attention
    if spec.valid_positions:
        kwargs["position_ids"] = valid_positions(attention, spec.valid_positions)
    if spec.pad_position is not None:
        positions = torch.arange(attention.shape[1], device=device).expand_as(attention)
        kwargs["position_ids"] = positions.masked_fill(attention == 0, spec.pad_position)
    out = model(ids, **kwargs)
    result: dict[str, torch.Tensor] = {}
    if spec.hidden != "none":
        result["hidden"] = hidden_of(spec, out, index, want_states)
        if spec.is_clip and spec.hidden == "last" and clip_skip > 0:
            result["hidden"] = clip_final_norm(model)(result["hidden"])
    if spec.pooled:
        projected = spec.kind == "clip_projection"
        result["pooled"] = out.text_embeds if projected else out.pooler_output
    if use_mask:
        result["mask"] = attention
        if spec.side == "left":
            result = to_front(result)
    if spec.trim and use_mask:
        return trimmed(result, spec.drop)
    return dropped(result, spec.drop)


def encode_with_images(spec: TextEncoderSpec, model: torch.nn.Module, processor: Any,
                       texts: list[str], images: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Encode texts with a vision-language encoder that reads each text's images (PIL, as
    given: sized by the caller) too: the spec's `image_prompt` once per image before the
    caption, in the spec's template; the processor (its tokenizer and image processor) pads
    to the longest and expands the image tokens; the model reads the pixels with the tokens.
    Returns "hidden" and "mask", trimmed and dropped as `encode` does."""
    assert spec.image_prompt is not None
    prompts = ["".join(spec.image_prompt.format(i + 1) for i in range(len(imgs)))
               + ((t or spec.empty or "") if imgs else t) for t, imgs in zip(texts, images)]
    flat = [img for imgs in images for img in imgs]
    inputs = processor(text=chat_texts(spec, processor, prompts), images=flat or None,
                       padding=True, padding_side=spec.side, return_tensors="pt")
    device = module_device(model)
    attention = inputs["attention_mask"].to(device)
    names = ("pixel_values", "image_grid_thw") + (("mm_token_type_ids",) if spec.token_types
                                                  else ())
    vision = {k: inputs[k].to(device) for k in names if k in inputs}
    out = model(input_ids=inputs["input_ids"].to(device), attention_mask=attention,
                output_hidden_states=True, **vision)
    result = {"hidden": hidden_of(spec, out, -1, True), "mask": attention}
    if spec.side == "left":
        result = to_front(result)
    return trimmed(result, spec.drop) if spec.trim else dropped(result, spec.drop)


def encode_all(
    specs: tuple[TextEncoderSpec, ...],
    c: Components,
    texts: list[str],
    options: EncodeOptions | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Every encoder's outputs by spec name (no grad: for sampling and cache filling; an
    encoder that reads images reads none here)."""
    options = options or EncodeOptions()

    def one(spec: TextEncoderSpec) -> dict[str, torch.Tensor]:
        model, tok = c.text_encoders[spec.name], c.tokenizers[spec.name]
        if spec.reads_images:
            return encode_with_images(spec, model, tok, texts, [[] for _ in texts])
        return encode(spec, model, tok, texts, max_length(spec, c.extras),
                      options.mask_for(spec), options.skip_for(spec))

    with torch.no_grad():
        return {spec.name: one(spec) for spec in specs}
