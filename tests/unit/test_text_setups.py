"""The text-encoder layer over every set-up: CLIP-only, T5-only, CLIP+T5, CLIP+CLIP+T5.

The families ship fixed set-ups (FLUX.1: CLIP+T5, SD3: CLIP+CLIP+T5, SDXL: CLIP+CLIP; those
train through the CLI in tests/e2e/test_text_setups_cli.py). Here the same core code (the text
source with its cache, `text.encode`, the LoRA injection and the optimizer groups) runs over
set-ups no shipped family has, through a probe family that joins any encoders' outputs. Each set-up
runs with text caching on and off, with no encoder trained and with each encoder trained.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from difftune.adapters.lora import add_lora, lora_parameters, suffix_patterns
from difftune.cache import MemoryStore, NullStore
from difftune.cache.sources import TextSource
from difftune.config import TEXT_ENCODER_TARGETS
from difftune.families.base import Components, TextEmbeds
from difftune.families.common import text
from difftune.families.sd3.tiny import build_tiny_sd3
from difftune.families.specs import TextEncoderSpec

CLIP_L = TextEncoderSpec("clip_l", "clip_projection", 77, hidden="penultimate", pooled=True)
CLIP_G = TextEncoderSpec("clip_g", "clip_projection", 77, hidden="penultimate", pooled=True)
T5 = TextEncoderSpec("t5", "t5", 256, hidden="last", pooled=False, mask=True)
SETUPS: dict[str, tuple[TextEncoderSpec, ...]] = {
    "clip": (CLIP_L,), "t5": (T5,), "clip+t5": (CLIP_L, T5), "clip+clip+t5": (CLIP_L, CLIP_G, T5),
}
CASES = [(setup, cache, trained) for setup, specs in SETUPS.items() for cache in (True, False)
         for trained in (None, *(s.name for s in specs))]
CAPTIONS = ["a red circle", "a pink ring on a blue background"]
STEPS = 3


class ProbeFamily:
    """Only what the text layer asks of a family: its specs and how outputs join.

    Hidden states are zero-padded to one width and joined along the sequence; pooled outputs
    are joined along features (as SD3 does for its two CLIPs).
    """

    name = "probe"

    def __init__(self, specs: tuple[TextEncoderSpec, ...]) -> None:
        self.text_encoders = specs

    def combine_text(self, c: Components, outputs: dict[str, dict[str, torch.Tensor]]) -> TextEmbeds:
        hidden = [o["hidden"] for o in outputs.values() if "hidden" in o]
        width = max(h.shape[-1] for h in hidden)
        padded = [torch.nn.functional.pad(h, (0, width - h.shape[-1])) for h in hidden]
        out = {"prompt_embeds": torch.cat(padded, dim=1)}
        pooled = [o["pooled"] for o in outputs.values() if "pooled" in o]
        if pooled:
            out["pooled_prompt_embeds"] = torch.cat(pooled, dim=-1)
        return TextEmbeds(out)


@pytest.fixture(scope="module")
def parts() -> dict[str, Any]:
    """The tiny SD3's encoders: a CLIP-L, a CLIP-G (both with projection) and a T5."""
    return build_tiny_sd3()


def components(parts: dict[str, Any], specs: tuple[TextEncoderSpec, ...]) -> Components:
    """Fresh copies of the encoders a set-up uses (LoRA injection changes them)."""
    import copy

    by_name = {"clip_l": ("text_encoder", "tokenizer"), "clip_g": ("text_encoder_2", "tokenizer_2"),
               "t5": ("text_encoder_3", "tokenizer_3")}
    return Components(
        denoiser=torch.nn.Identity(), vae=torch.nn.Identity(),
        text_encoders={s.name: copy.deepcopy(parts[by_name[s.name][0]]).eval() for s in specs},
        tokenizers={s.name: parts[by_name[s.name][1]] for s in specs},
        scheduler=None, name="probe", fingerprint="probe",
        extras={"max_length": {"t5": parts["t5_max_length"]}})


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("setup, cache, trained", CASES)
def test_setup_trains(parts: dict[str, Any], monkeypatch: pytest.MonkeyPatch, setup: str,
                      cache: bool, trained: str | None) -> None:
    specs = SETUPS[setup]
    comps = components(parts, specs)
    names = [trained] if trained else []
    for name in names:
        add_lora(comps.text_encoders[name], suffix_patterns(list(TEXT_ENCODER_TARGETS)), 4, 4.0,
                 0.0, seed=1)
        comps.text_encoders[name].train()
    frozen = {n: _state(m) for n, m in comps.text_encoders.items()}
    calls: list[tuple[str, bool]] = []
    real = text.encode

    def counting(spec: TextEncoderSpec, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        calls.append((spec.name, torch.is_grad_enabled()))
        return real(spec, *args, **kwargs)

    monkeypatch.setattr(text, "encode", counting)
    store = MemoryStore() if cache else NullStore()
    source = TextSource(ProbeFamily(specs), comps, store, trained=names)
    # The "denoiser": a linear read-out of the joined embeddings, trained with the LoRA.
    first = source.get(CAPTIONS[:1]).tensors
    head = torch.nn.ModuleDict({k: torch.nn.Linear(v.shape[-1], 1) for k, v in first.items()})
    lora = [p for n in names for p in lora_parameters(comps.text_encoders[n])]
    before = [p.detach().clone() for p in lora]
    opt = torch.optim.AdamW([*head.parameters(), *lora], lr=1e-2)
    calls.clear()
    for step in range(STEPS):
        embeds = source.get([CAPTIONS[step % 2]])
        loss = sum(((head[k](v) - 1.0) ** 2).mean() for k, v in embeds.tensors.items())
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for spec in specs:
        grads = [grad for name, grad in calls if name == spec.name]
        if spec.name == trained:
            assert grads == [True] * STEPS  # live, with gradients, every step
        elif cache:
            assert grads == [False]  # the second caption once; the first was cached above
        else:
            assert grads == [False] * STEPS  # nothing kept: encoded again every step, no grad
    if trained:
        assert any(not torch.equal(b, p) for b, p in zip(before, lora))
        assert all(p.grad is None for p in lora)
    for name, module in comps.text_encoders.items():
        after = _state(module)
        assert all(torch.equal(frozen[name][k], after[k]) for k in after), name
    entries = len(store) if cache else 0
    assert entries == (len(specs) - len(names)) * len(CAPTIONS) * cache
