"""Cache keys change with everything that decides an entry's value, and only with that."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from difftune.cache import MemoryStore, NullStore, entry_key, latent_fields, text_fields

ENC = [{"name": "t5", "max_length": 32, "mask": False}]


def lkey(image: Path, **kw: object) -> str:
    args = dict(family="flux", fingerprint="m1", dtype="float32", image=image, bucket=(64, 64),
                box=(0, 0, 64, 64), flip=False)
    args.update(kw)
    return entry_key(latent_fields(**args))


def sha256_of_json(fields: dict[str, object]) -> str:
    """The documented key: sha256 of the fields' canonical JSON (sorted keys, no spaces)."""
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def test_latent_key_follows_content_and_preprocessing(tmp_path: Path) -> None:
    img = tmp_path / "a.png"
    img.write_bytes(b"one")
    base = lkey(img)
    # Computed here from the image's bytes, not by the code under test.
    assert base == sha256_of_json({
        "kind": "latent", "family": "flux", "model": "m1", "dtype": "float32",
        "image_sha256": hashlib.sha256(b"one").hexdigest(), "bucket": [64, 64],
        "box": [0, 0, 64, 64], "flip": False})
    for change in ({"flip": True}, {"bucket": (64, 48)}, {"box": (1, 0, 65, 64)},
                   {"fingerprint": "m2"}, {"dtype": "bfloat16"}, {"family": "sd3"}):
        assert lkey(img, **change) != base, change
    img.write_bytes(b"two")  # an edited image gets a new key, even with the same name
    os.utime(img, ns=(1, 1))
    assert lkey(img) != base
    copy = tmp_path / "b.png"
    copy.write_bytes(b"two")  # identical bytes elsewhere: same content, same key
    assert lkey(copy) == lkey(img)


def test_text_key_is_exact_caption_and_encoder_settings() -> None:
    def tkey(caption: str, encoders: list[dict[str, object]] = ENC) -> str:
        return entry_key(text_fields(family="flux", fingerprint="m1", dtype="float32",
                                     caption=caption, encoders=encoders))
    assert tkey("a cat") == sha256_of_json({
        "kind": "text", "family": "flux", "model": "m1", "dtype": "float32",
        "caption": "a cat", "encoders": ENC})
    # The same settings written in another order are the same entry.
    assert tkey("a cat", [{"mask": False, "max_length": 32, "name": "t5"}]) == tkey("a cat")
    assert tkey("a cat") != tkey("a cat ")
    assert tkey("a cat") != tkey("a cat", [{"name": "t5", "max_length": 64, "mask": False}])


def test_stores() -> None:
    import torch

    mem = MemoryStore()
    mem.put("k", {"x": torch.ones(2)}, {"kind": "test"})
    assert "k" in mem and torch.equal(mem.get("k")["x"], torch.ones(2))
    assert mem.get("other") is None
    null = NullStore()
    null.put("k", {"x": torch.ones(2)}, {})
    assert null.get("k") is None and "k" not in null
