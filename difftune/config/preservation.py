"""The `[preservation]` section: differential output preservation, and what it refuses.

For a caption holding the trigger word, the same caption without it is also trained, its
target being the base model's own prediction (the adapter switched off, same noisy latents and
timesteps): the adapter learns the concept while what the model makes of everything else stays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from difftune.config.base import Section as _Section

if TYPE_CHECKING:
    from difftune.config.run import RunConfig


class PreservationConfig(_Section):
    """Output preservation: off while `trigger` is empty."""

    trigger: str = Field("", description="The word(s) whose captions are also trained without "
                                         "them against the base model's prediction; \"\": off.")
    replacement: str = Field("", description="What takes the trigger's place in the "
                                             "trigger-free caption (e.g. the class word).")
    weight: float = Field(1.0, gt=0, description="The preservation loss's weight in the loss.")

    @property
    def enabled(self) -> bool:
        """Whether output preservation is on."""
        return bool(self.trigger.strip())


def preservation_problems(cfg: "RunConfig") -> list[str]:
    """Settings output preservation cannot work with (checked at load)."""
    p = cfg.preservation
    if not p.enabled:
        return []
    problems = []
    if cfg.adapter.peft_kind is None:
        problems.append(f"preservation.trigger needs an adapter to switch off for the base "
                        f"model's prediction; adapter.type = \"{cfg.adapter.type}\" has none "
                        "(train a LoRA, or leave preservation.trigger empty)")
    if cfg.adapter.embeddings:
        problems.append("preservation.trigger: the base model's prediction cannot switch off "
                        "learned embeddings ([[adapter.embeddings]]); remove one or the other")
    if cfg.train.distributed == "fsdp":
        problems.append("preservation.trigger is not supported with train.distributed = "
                        "\"fsdp\"; use \"ddp\" or leave preservation.trigger empty")
    if p.trigger.strip() == p.replacement.strip():
        problems.append("preservation.replacement equals preservation.trigger: the captions "
                        "would not change; choose another replacement (e.g. the class word)")
    return problems
