"""Caption augmentations, and the exact text each training sample sees.

Per subset, in this order: prefix and suffix (fixed), whole-caption dropout, then the random
per-sample ones (wildcards `{a|b}`, tag shuffle with `keep_tokens`, tag dropout), then token
warm-up (only the first N tags, N growing with the step). Every choice is drawn from the
sampler's per-sample seed, so a sample sees the same text after a resume and whether text
caching is on or off. With `variants = K > 0` the random part is one of K variants per caption
drawn from the run seed, so every text a run can ask for is known up front and can be
pre-encoded; with K = 0 each sample draws afresh and its text is encoded on demand.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from difftune.config import SubsetConfig
    from difftune.data.discover import Item

WILDCARD = re.compile(r"\{([^{}]*\|[^{}]*)\}")


@dataclass(frozen=True)
class CaptionAugment:
    """One subset's caption augmentations (see `SubsetConfig` for each field's meaning)."""

    prefix: str = ""
    suffix: str = ""
    wildcards: bool = False
    shuffle: bool = False
    keep_tokens: int = 0
    separator: str = ","
    tag_dropout: float = 0.0
    dropout: float = 0.0
    warmup_min: int = 1
    warmup_steps: int = 0

    @classmethod
    def from_subset(cls, sub: "SubsetConfig") -> "CaptionAugment":
        """The augmentations a subset config asks for."""
        return cls(sub.caption_prefix, sub.caption_suffix, sub.wildcards, sub.shuffle_caption,
                   sub.keep_tokens, sub.caption_separator, sub.caption_tag_dropout_rate,
                   sub.caption_dropout_rate, sub.token_warmup_min, sub.token_warmup_steps)

    def fixed(self, caption: str) -> str:
        """The caption with prefix and suffix (the part that is the same for every sample)."""
        return " ".join(t for t in (self.prefix, caption, self.suffix) if t)

    def is_random(self, caption: str) -> bool:
        """Whether samples of this caption differ beyond dropout and warm-up."""
        return (self.shuffle or self.tag_dropout > 0
                or (self.wildcards and WILDCARD.search(caption) is not None))

    def _tags(self, text: str) -> list[str]:
        return [t.strip() for t in text.split(self.separator) if t.strip()]

    def _join(self, tags: list[str]) -> str:
        return f"{self.separator} ".join(tags) if self.separator.strip() else self.separator.join(tags)

    def variant(self, text: str, rng: random.Random) -> str:
        """Wildcards resolved, then the tags after the first `keep_tokens` shuffled and dropped."""
        if self.wildcards:
            text = WILDCARD.sub(lambda m: rng.choice(m.group(1).split("|")), text)
        if not (self.shuffle or self.tag_dropout > 0):
            return text
        tags = self._tags(text)
        kept, rest = tags[: self.keep_tokens], tags[self.keep_tokens :]
        if self.shuffle:
            rng.shuffle(rest)
        if self.tag_dropout > 0:
            rest = [t for t in rest if rng.random() >= self.tag_dropout]
        return self._join(kept + rest)

    def tag_count(self, total: int, step: int) -> int:
        """Tags kept at `step` of the warm-up: `warmup_min` at step 0, all at `warmup_steps`."""
        if not self.warmup_steps or step >= self.warmup_steps:
            return total
        return min(total, self.warmup_min + (total - self.warmup_min) * step // self.warmup_steps)

    def warm(self, text: str, step: int) -> str:
        """The first `tag_count` tags of `text` (unchanged outside the warm-up)."""
        if not self.warmup_steps or step >= self.warmup_steps:
            return text
        tags = self._tags(text)
        return self._join(tags[: self.tag_count(len(tags), step)])


class Captions:
    """The text each sample sees: item, per-sample seed and step in, exact caption out.

    `variants` is `cache.caption_variants` (K). Nothing here depends on whether or how text is
    cached, so a run trains on the same texts with caching on or off.
    """

    def __init__(self, items: list["Item"], seed: int, variants: int = 0) -> None:
        self.items, self.seed, self.variants = items, seed, variants

    def text(self, index: int, sample_seed: int | None, step: int) -> str:
        """The caption sample `sample_seed` of item `index` sees at `step`.

        `sample_seed = None` (a check, or a caller without a sampler) gives the fixed caption.
        """
        item = self.items[index]
        aug, base = item.augment, item.augment.fixed(item.caption)
        if sample_seed is None:
            return base
        rng = random.Random(f"caption:{sample_seed}")
        if aug.dropout and rng.random() < aug.dropout:
            return ""  # exactly the empty caption, so its cached embedding serves every drop
        text = base
        if aug.is_random(base):
            pick = rng.randrange(self.variants) if self.variants else None
            text = aug.variant(base, self._variant_rng(index, pick) if pick is not None else rng)
        return aug.warm(text, step)

    def _variant_rng(self, index: int, k: int) -> random.Random:
        """The generator of variant k of item `index`: fixed by the run seed alone."""
        return random.Random(f"variant:{self.seed}:{index}:{k}")

    def known_texts(self, index: int) -> list[str] | None:
        """Every text item `index` can show, when that set is finite; else None.

        With K variants (or no random augmentation) it is finite: each variant, each of its
        warm-up truncations, and "" when dropout is on. With K = 0 and a random augmentation it
        is not: those texts are encoded on demand.
        """
        item = self.items[index]
        aug, base = item.augment, item.augment.fixed(item.caption)
        if aug.is_random(base) and not self.variants:
            return None
        texts = ([aug.variant(base, self._variant_rng(index, k)) for k in range(self.variants)]
                 if aug.is_random(base) else [base])
        if aug.warmup_steps:
            texts = [aug.warm(t, s) for t in texts for s in _warmup_steps(aug, t)]
        if aug.dropout:
            texts.append("")
        return list(dict.fromkeys(texts))

    def describe(self, index: int) -> list[str]:
        """The augmentations of item `index`'s subset, as words for `difftune check`."""
        aug = self.items[index].augment
        words = []
        if aug.prefix or aug.suffix:
            words.append("prefix/suffix")
        if aug.wildcards:
            words.append("wildcards")
        if aug.shuffle:
            words.append(f"shuffle (keep {aug.keep_tokens})")
        if aug.tag_dropout:
            words.append(f"tag dropout {aug.tag_dropout:g}")
        if aug.dropout:
            words.append(f"caption dropout {aug.dropout:g} (cached empty caption)")
        if aug.warmup_steps:
            words.append(f"token warm-up {aug.warmup_min}->all over {aug.warmup_steps} steps")
        return words


def _warmup_steps(aug: CaptionAugment, text: str) -> list[int]:
    """One step per distinct warm-up tag count of `text` (and the end of the warm-up).

    The count grows in integer jumps, so the first step that reaches each candidate count is
    solved for directly: the cost is the number of tags, not of warm-up steps (walking every
    step of a long warm-up never returned).
    """
    total = len(aug._tags(text))
    span, steps = total - aug.warmup_min, aug.warmup_steps
    # warmup_min + span * s // steps (tag_count) reaches c first at
    # s = ceil((c - warmup_min) * steps / span).
    starts = [0] + ([-(-(c - aug.warmup_min) * steps // span)
                     for c in range(aug.warmup_min + 1, total + 1)] if span > 0 else [])
    first: dict[int, int] = {}
    for step in sorted(set(starts + [steps])):
        first.setdefault(aug.tag_count(total, step), step)
    return list(first.values())
