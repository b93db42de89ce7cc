"""Caption augmentations: each does what it says, deterministically, and the variant set is known."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from difftune.data.captions import CaptionAugment, Captions
from difftune.data.discover import Item

CAPTION = "sks, red circle, blue background, centered, flat colors, simple"
TAGS = [t.strip() for t in CAPTION.split(",")]


def item(caption: str = CAPTION, **aug: object) -> Item:
    return Item(path=Path("x.png"), caption=caption, size=(64, 64), bucket=(64, 64), dataset=0,
                subset=0, repeats=1, flip=False, crop="center", augment=CaptionAugment(**aug))


def texts(captions: Captions, n: int = 200, step: int = 10**6) -> list[str]:
    return [captions.text(0, seed, step) for seed in range(n)]


def test_no_augmentation_is_the_caption_exactly() -> None:
    c = Captions([item()], seed=1)
    assert set(texts(c)) == {CAPTION}
    assert c.known_texts(0) == [CAPTION]


def test_prefix_and_suffix() -> None:
    c = Captions([item(prefix="photo of", suffix="4k")], seed=1)
    assert set(texts(c)) == {f"photo of {CAPTION} 4k"}


def test_shuffle_keeps_the_first_tokens_and_permutes_the_rest() -> None:
    c = Captions([item(shuffle=True, keep_tokens=1)], seed=1)
    seen = texts(c)
    assert len(set(seen)) > 20
    for text in seen:
        tags = text.split(", ")
        assert tags[0] == "sks" and sorted(tags) == sorted(TAGS)
    assert seen == texts(Captions([item(shuffle=True, keep_tokens=1)], seed=1))  # deterministic


def test_tag_dropout_rate_and_kept_tokens() -> None:
    c = Captions([item(tag_dropout=0.3, keep_tokens=2)], seed=1)
    seen = texts(c, 2000)
    counts = Counter(tag for t in seen for tag in t.split(", "))
    assert counts["sks"] == counts["red circle"] == 2000
    kept = sum(counts[t] for t in TAGS[2:]) / (2000 * len(TAGS[2:]))
    assert 0.66 < kept < 0.74  # 1 - 0.3
    assert all(t.split(", ")[:2] == TAGS[:2] for t in seen)  # order kept without shuffle


def test_whole_caption_dropout_gives_the_empty_caption() -> None:
    c = Captions([item(dropout=0.25)], seed=1)
    seen = texts(c, 2000)
    assert set(seen) == {"", CAPTION}
    assert 0.22 < seen.count("") / 2000 < 0.28
    assert c.known_texts(0) == [CAPTION, ""]


def test_wildcards() -> None:
    c = Captions([item("a {red|green|blue} circle, {small|large}", wildcards=True)], seed=1)
    seen = set(texts(c))
    assert seen == {f"a {col} circle, {size}" for col in ("red", "green", "blue")
                    for size in ("small", "large")}
    off = Captions([item("a {red|green} circle")], seed=1)
    assert set(texts(off)) == {"a {red|green} circle"}


def test_token_warmup_grows_with_the_step() -> None:
    c = Captions([item(warmup_min=2, warmup_steps=8)], seed=1)
    counts = [len(c.text(0, 0, step).split(", ")) for step in range(10)]
    assert counts[0] == 2 and counts[-1] == len(TAGS) and counts == sorted(counts)
    assert c.text(0, 0, 0) == "sks, red circle"  # the leading tags, in order


def test_variants_bound_the_random_texts_and_are_all_known() -> None:
    aug = dict(shuffle=True, keep_tokens=1, tag_dropout=0.1, dropout=0.1, warmup_steps=5)
    c = Captions([item(**aug)], seed=3, variants=4)
    seen = {c.text(0, seed, step) for seed in range(300) for step in range(7)}
    known = set(c.known_texts(0))
    assert seen <= known and "" in seen
    after_warmup = {c.text(0, s, 100) for s in range(300)} - {""}
    assert 1 < len(after_warmup) <= 4  # at most K random variants
    live = Captions([item(**aug)], seed=3, variants=0)
    assert live.known_texts(0) is None  # drawn afresh per sample: encoded on demand
    # Variants depend on the run seed only, not on which sample picks them.
    assert Captions([item(**aug)], seed=3, variants=4).known_texts(0) == c.known_texts(0)
    assert Captions([item(**aug)], seed=4, variants=4).known_texts(0) != c.known_texts(0)


def test_describe_names_every_augmentation() -> None:
    c = Captions([item(prefix="p", wildcards=True, shuffle=True, keep_tokens=1, tag_dropout=0.1,
                       dropout=0.1, warmup_steps=3)], seed=1)
    words = " ".join(c.describe(0))
    for needle in ("prefix", "wildcards", "shuffle", "tag dropout", "caption dropout", "warm-up"):
        assert needle in words


@pytest.mark.parametrize("field, value", [("keep_tokens", 2), ("token_warmup_min", 3),
                                          ("caption_separator", ";")])
def test_ignored_caption_options_are_named(field: str, value: object) -> None:
    from difftune.config import SubsetConfig

    sub = SubsetConfig(path=Path("x"), **{field: value})
    assert any(o.startswith(field) for o in sub.ignored_caption_options())
    assert not SubsetConfig(path=Path("x"), shuffle_caption=True, token_warmup_steps=5,
                            **{field: value}).ignored_caption_options()


@pytest.mark.parametrize("warmup_min, steps", [(1, 3), (2, 8), (1, 5), (3, 40), (6, 9), (9, 4)])
def test_warmup_texts_are_every_truncation_a_step_can_show(warmup_min: int, steps: int) -> None:
    c = Captions([item(warmup_min=warmup_min, warmup_steps=steps)], seed=1)
    shown = {c.text(0, 7, step) for step in range(steps + 2)}
    assert set(c.known_texts(0)) == shown


def test_a_long_warmup_is_listed_without_walking_its_steps() -> None:
    """known_texts once walked every warm-up step: 10**12 of them never returned."""
    c = Captions([item(warmup_steps=10**12)], seed=1)
    assert c.known_texts(0) == [", ".join(TAGS[:n]) for n in range(1, len(TAGS) + 1)]
