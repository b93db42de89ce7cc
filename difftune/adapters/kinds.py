"""The adapter kinds trained through peft: LoRA (and DoRA), LoCon, LoHa and LoKr.

Each kind is one registry entry saying which peft config builds it and which peft parameter
names hold its factors; the injection path (`adapters.lora.add_lora`), the checkpoint's list
of trained parameters and the file writers all go through this table, so adding a kind is one
entry here (and its file layout in `adapters.lycoris_files`).

LoCon is LoRA on Linear and Conv2d layers (LyCORIS's name for it); on Linear layers alone it
is plain LoRA. peft implements every kind; nothing here computes a weight update.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig

# peft's scale is alpha / r; full-rank LoKr passes a rank no layer reaches (every factor
# whole) with alpha equal to it, so its scale is 1, as LyCORIS reads a full LoKr.
FULL_RANK = 1 << 30


@dataclass(frozen=True)
class AdapterOptions:
    """What a kind's peft config is made from (the adapter section's numbers)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    dora: bool = False
    factor: int = -1
    decompose_both: bool = False
    full_matrix: bool = False
    conv_rank: int | None = None
    conv_alpha: float | None = None


@dataclass(frozen=True)
class Kind:
    """One adapter kind: its peft config, its factor names, and what its files call it."""

    name: str
    factors: tuple[str, ...]  # peft attribute names of the trained tensors (file names too)
    build: Callable[[list[str], list[str], AdapterOptions], PeftConfig]
    algo: str  # LyCORIS's `algo` name (ss_network_args), what the file says it is
    label: str  # how messages and `check` name it


def _lora(linear: list[str], conv: list[str], o: AdapterOptions) -> PeftConfig:
    """peft LoRA (DoRA with `o.dora`) on the Linear layers and, for LoCon, the Conv2d ones."""
    return LoraConfig(
        r=o.rank, lora_alpha=o.alpha, lora_dropout=o.dropout, target_modules=linear + conv,
        init_lora_weights=True, use_dora=o.dora, **_conv_patterns(conv, o))


def _loha(linear: list[str], conv: list[str], o: AdapterOptions) -> PeftConfig:
    """peft LoHa: (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r, w2_b zero at the start."""
    return LoHaConfig(r=o.rank, alpha=o.alpha, target_modules=linear + conv, init_weights=True,
                      **_conv_patterns(conv, o))


def _lokr(linear: list[str], conv: list[str], o: AdapterOptions) -> PeftConfig:
    """peft LoKr: kron(w1, w2) * alpha / r (w1 zero at the start); full rank keeps both
    factors whole and scales by 1."""
    rank, alpha = (FULL_RANK, float(FULL_RANK)) if o.full_matrix else (o.rank, o.alpha)
    patterns = {} if o.full_matrix else _conv_patterns(conv, o)
    return LoKrConfig(r=rank, alpha=alpha, target_modules=linear + conv, init_weights=True,
                      decompose_both=o.decompose_both, decompose_factor=o.factor, **patterns)


def _conv_patterns(conv: list[str], o: AdapterOptions) -> dict[str, dict]:
    """peft's per-module rank and alpha for the Conv2d targets (conv_rank, conv_alpha)."""
    if not conv or o.conv_rank is None:
        return {}
    alpha = o.conv_alpha if o.conv_alpha is not None else float(o.conv_rank)
    exact = {f"^{re.escape(n)}$": None for n in conv}
    return {"rank_pattern": {k: o.conv_rank for k in exact},
            "alpha_pattern": {k: alpha for k in exact}}


KINDS: dict[str, Kind] = {
    "lora": Kind("lora", ("lora_A", "lora_B", "lora_magnitude_vector"), _lora, "lora", "LoRA"),
    "locon": Kind("locon", ("lora_A", "lora_B", "lora_magnitude_vector"), _lora, "locon",
                  "LoCon"),
    "loha": Kind("loha", ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"), _loha, "loha",
                 "LoHa"),
    "lokr": Kind("lokr", ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a",
                          "lokr_w2_b", "lokr_t2"), _lokr, "lokr", "LoKr"),
}
# Any kind's trained tensor, by its peft parameter name (`<module>.<factor>.<adapter>...`).
_FACTOR = re.compile(r"\.(" + "|".join(sorted({f for k in KINDS.values() for f in k.factors}))
                     + r")\.")


def kind(name: str) -> Kind:
    """The registered kind `name` (config validation keeps the names to these)."""
    return KINDS[name]


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (from `named_parameters()`) is a trained adapter factor, of
    any kind: what the checkpoint saves and `check` counts, never the base weights."""
    return _FACTOR.search(name + ".") is not None


def adapter_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The adapter parameters of the model (any kind), in module order."""
    return [p for n, p in model.named_parameters() if is_adapter_parameter(n)]


def uses_lycoris_layout(kind_name: str, dora: bool) -> bool:
    """Whether the kind's files are written in the LyCORIS layout (`lycoris_files`): every
    kind but plain LoRA, whose layouts are the family's own (diffusers, kohya); neither
    embeddings alone nor a full fine-tune writes adapter factors."""
    return kind_name in KINDS and (kind_name != "lora" or dora)
