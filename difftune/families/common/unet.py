"""What the UNet families (SD 1.5, SDXL) share: LoRA presets over UNet2DConditionModel's
module names and the discrete DDPM objective read from the loaded scheduler's config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from difftune.families.base import Components
from difftune.families.common.family import FamilyBase
from difftune.train.objectives.ddpm import DDPMObjective, DDPMSchedule

if TYPE_CHECKING:
    from difftune.config import TrainConfig
    from difftune.train.objectives import Objective

# Module-name patterns (full match against the UNet's module names) for LoRA presets.
# Transformer blocks live in down/mid/up blocks' `attentions.N.transformer_blocks.M`.
_ATTENTIONS = r"(?:down_blocks\.\d+|up_blocks\.\d+|mid_block)\.attentions\.\d+\."
_TRANSFORMER = _ATTENTIONS + r"transformer_blocks\.\d+\."
_ATTENTION = [_TRANSFORMER + r"(?:attn1|attn2)\.(?:to_q|to_k|to_v|to_out\.0)"]
_MLP = [_TRANSFORMER + r"ff\.net\.(?:0\.proj|2)"]
_OTHER = [
    _ATTENTIONS + r"(?:proj_in|proj_out)",
    r"(?:down_blocks\.\d+|up_blocks\.\d+|mid_block)\.resnets\.\d+\.time_emb_proj",
]
UNET_PRESETS: dict[str, list[str]] = {
    "attention": _ATTENTION,
    "attention_mlp": _ATTENTION + _MLP,
    "all_linear": _ATTENTION + _MLP + _OTHER,
}


class DDPMUNetFamily(FamilyBase):
    """A family whose denoiser is a UNet2DConditionModel trained as a discrete DDPM."""

    presets = UNET_PRESETS

    def objective(self, c: Components, cfg: TrainConfig) -> Objective:
        """Discrete DDPM on the scheduler's schedule; prediction type from the config or, on
        "auto", from the scheduler's `prediction_type` (what the checkpoint was trained with:
        epsilon, or v_prediction for v-prediction bases)."""
        sc = c.scheduler.config
        schedule = DDPMSchedule.scaled_linear(
            int(sc.num_train_timesteps), float(sc.beta_start), float(sc.beta_end),
            zero_terminal_snr=cfg.zero_terminal_snr)
        prediction = cfg.prediction if cfg.prediction != "auto" else sc.prediction_type
        return DDPMObjective(schedule, prediction, noise_offset=cfg.noise_offset,
                             min_snr_gamma=cfg.min_snr_gamma)
