"""The `adapter` section: what a run trains (LoRA and the LyCORIS kinds, a full fine-tune,
textual-inversion embeddings) and the options of each kind.

Kept apart from `sections` so each module stays small; the kinds' cross-option rules are
checked here, the family-dependent ones in `checks`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from difftune.config.base import Section as _Section

# Default text-encoder LoRA targets: attention and MLP Linear layers of CLIP and of T5.
TEXT_ENCODER_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2",
                        "q", "k", "v", "o", "wi_0", "wi_1", "wo")


class EmbeddingConfig(_Section):
    """A new placeholder token trained as textual-inversion embeddings."""

    name: str = Field(..., pattern=r"^\S+$",
                      description="The placeholder as written in captions and prompts, e.g. <sks>.")
    tokens: int = Field(1, ge=1, le=32, description="Vectors per placeholder.")
    init: str = Field("*", min_length=1, description="Text whose token embeddings start it.")
    encoders: list[str] | None = Field(
        None, description="Text encoders that learn it (default: every one of the family).")
    kind: Literal["input", "output"] = Field(
        "input", description="input: new rows of the token-embedding table; output: vectors "
                             "that replace the encoder's output at the placeholder positions.")


# Adapter kinds trained through peft on the denoiser (and text encoders); see adapters/kinds.py.
PEFT_KINDS = ("lora", "locon", "loha", "lokr")


class AdapterConfig(_Section):
    """The adapter (LoRA, LoCon, LoHa, LoKr, a full fine-tune, and/or textual-inversion
    embeddings) to train."""

    type: Literal["lora", "locon", "loha", "lokr", "embedding", "full"] = Field(
        "lora", description="lora (optionally with embeddings: pivotal tuning), the LyCORIS "
                            "kinds locon (LoRA on Linear and Conv2d layers), loha (Hadamard "
                            "product) and lokr (Kronecker product), embedding (textual "
                            "inversion alone) or full (the denoiser's own weights, fp32 master "
                            "weights; see adapters/full.py).")
    train_blocks: list[str] | None = Field(
        None, min_length=1,
        description="adapter.type = \"full\": train only the denoiser modules these glob "
                    "patterns name (e.g. [\"transformer_blocks.*\"]); default: all of it.")
    embeddings: list[EmbeddingConfig] = Field(
        default_factory=list, description="Placeholder tokens to learn ([[adapter.embeddings]]).")
    embedding_lr: float | None = Field(
        None, gt=0, description="Learning rate of the embeddings (default: train.lr).")
    rank: int = Field(16, ge=1, le=1024, description="LoRA rank (LyCORIS: linear_dim).")
    alpha: float | None = Field(None, gt=0, description="LoRA alpha (default: the rank; "
                                "LyCORIS: linear_alpha).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input "
                           "(lora and locon).")
    dora: bool = Field(False, description="DoRA: weight-decomposed LoRA (a learned magnitude per "
                       "output row; lora and locon; LyCORIS: weight_decompose, dora_wd).")
    factor: int = Field(-1, description="lokr: the Kronecker factor (LyCORIS `factor`): the "
                        "size of the small factor's side; -1 picks it automatically.")
    decompose_both: bool = Field(False, description="lokr: also split the small Kronecker "
                                 "factor into two rank-`rank` matrices (LyCORIS decompose_both).")
    full_matrix: bool = Field(False, description="lokr: full-rank LoKr, no low-rank split of "
                              "either factor (LyCORIS full_matrix; SimpleTuner's linear_dim = "
                              "10000); alpha then has no effect, as in LyCORIS.")
    conv_rank: int | None = Field(None, ge=1, le=1024, description="locon/loha/lokr: rank on "
                                  "the denoiser's Conv2d layers too (LyCORIS conv_dim); only "
                                  "families with convolutions (SDXL's UNet); unset: Linear only.")
    conv_alpha: float | None = Field(None, gt=0, description="Alpha of the Conv2d layers "
                                     "(LyCORIS conv_alpha; default: conv_rank).")
    targets: Literal["attention", "attention_mlp", "all_linear"] = Field(
        "attention", description="Preset of layers that get a LoRA."
    )
    target_modules: list[str] | None = Field(
        None, description="Explicit module-name suffixes; overrides `targets` when set."
    )
    text_encoders: list[str] = Field(
        default_factory=list,
        description='Text encoders that train too, by name (e.g. ["clip_l"]): a LoRA on each, '
                    'or with adapter.type = "full" their own weights; never cached.',
    )
    text_encoder_targets: list[str] = Field(
        default_factory=lambda: list(TEXT_ENCODER_TARGETS),
        description="Module-name suffixes of the text encoders that get a LoRA.",
    )
    text_encoder_lr: float | None = Field(
        None, gt=0, description="Learning rate of the text-encoder LoRA (default: train.lr)."
    )

    @property
    def scale_alpha(self) -> float:
        """The alpha actually used (the rank when unset)."""
        return float(self.alpha if self.alpha is not None else self.rank)

    @property
    def peft_kind(self) -> str | None:
        """The peft-trained adapter kind (`adapters.kinds`), None for embeddings alone."""
        return self.type if self.type in PEFT_KINDS else None

    @model_validator(mode="after")
    def _kind_options(self) -> "AdapterConfig":
        problems = []
        if self.dora and self.type not in ("lora", "locon"):
            problems.append(f"adapter.dora works with adapter.type = \"lora\" or \"locon\" "
                            f"(peft's DoRA), not \"{self.type}\"; remove adapter.dora or "
                            "change adapter.type")
        lokr_only = [n for n in ("decompose_both", "full_matrix") if getattr(self, n)]
        if self.factor != -1:
            lokr_only.append("factor")
        if self.type != "lokr" and lokr_only:
            problems.append(f"adapter.{lokr_only[0]} is a LoKr option; set adapter.type = "
                            "\"lokr\" or remove it")
        if self.factor == 0 or self.factor < -1:
            problems.append("adapter.factor must be -1 (automatic) or a positive factor")
        if self.full_matrix and self.decompose_both:
            problems.append("adapter.full_matrix trains both Kronecker factors whole, so "
                            "adapter.decompose_both cannot split one; remove one of them")
        conv = self.conv_rank is not None or self.conv_alpha is not None
        if conv and self.type not in ("locon", "loha", "lokr"):
            problems.append(f"adapter.conv_rank / conv_alpha adapt Conv2d layers, which "
                            f"adapter.type = \"{self.type}\" does not; use \"locon\", "
                            "\"loha\" or \"lokr\"")
        if self.conv_alpha is not None and self.conv_rank is None:
            problems.append("adapter.conv_alpha needs adapter.conv_rank (the Conv2d rank)")
        if self.dropout and self.type in ("loha", "lokr"):
            problems.append(f"adapter.dropout is LoRA's input dropout; peft's {self.type} "
                            "has none; set adapter.dropout = 0")
        if problems:
            raise ValueError("; ".join(problems))
        return self
