"""`families.base.pad_cat` / `TextEmbeds.cat`: variable-length text embeddings batch with a mask.

Trimmed cache entries hold each caption's own tokens; a batch pads them at the end with zeros
and marks the padding invalid in the mask, and equal lengths concatenate exactly as before.
"""

from __future__ import annotations

import pytest
import torch

from difftune.families.base import TextEmbeds, pad_cat


def _item(n: int, fill: float) -> dict[str, torch.Tensor]:
    return {"hidden": torch.full((1, n, 3), fill), "mask": torch.ones(1, n, dtype=torch.long),
            "pooled": torch.full((1, 5), fill)}


def test_unequal_lengths_are_padded_and_masked() -> None:
    out = pad_cat([_item(2, 1.0), _item(4, 2.0)])
    assert out["hidden"].shape == (2, 4, 3)
    assert torch.equal(out["mask"], torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert torch.equal(out["hidden"][0, 2:], torch.zeros(2, 3))
    assert torch.equal(out["hidden"][0, :2], torch.ones(2, 3))
    assert out["pooled"].shape == (2, 5)  # not a sequence tensor: concatenated as is


def test_equal_lengths_concatenate_unchanged() -> None:
    a, b = _item(3, 1.0), _item(3, 2.0)
    out = pad_cat([a, b])
    for k in a:
        assert torch.equal(out[k], torch.cat([a[k], b[k]]))


def test_unequal_lengths_without_a_mask_are_refused() -> None:
    with pytest.raises(ValueError, match="no mask"):
        pad_cat([{"hidden": torch.zeros(1, 2, 3)}, {"hidden": torch.zeros(1, 4, 3)}])


def test_text_embeds_cat_pads_named_masks() -> None:
    items = [TextEmbeds({"prompt_embeds": torch.ones(1, n, 2),
                         "prompt_embeds_mask": torch.ones(1, n, dtype=torch.bool)}) for n in (1, 3)]
    out = TextEmbeds.cat(items).tensors
    assert torch.equal(out["prompt_embeds_mask"], torch.tensor([[True, False, False], [True] * 3]))
    assert out["prompt_embeds"][0, 1:].abs().sum() == 0
