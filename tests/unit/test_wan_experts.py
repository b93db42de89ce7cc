"""Wan 2.2 A14B's two experts as one module: each expert's timesteps drawn from its side of
the boundary with the schedule's own density there, each row routed to the expert WanPipeline
would run at its timestep, a sample running both experts, and keep_best keeping pairs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from difftune import families
from difftune.config import ModelConfig, PrecisionConfig, TrainConfig
from difftune.families.common.experts import Experts
from difftune.families.wan.files import SCHEDULER_CONFIG
from difftune.precision.policy import PrecisionPolicy
from difftune.train.objectives.flow import sample_timesteps, scheduler_shift, window_timesteps

BOUNDARY = 0.875
TOKENS = 1024


@pytest.mark.parametrize("mode", ["uniform", "sigmoid", "shift", "flux_shift"])
def test_each_side_draws_the_schedule_restricted_to_it(mode: str) -> None:
    """Every draw of the high-noise side is at or above 875 of 1000 as the model is given it
    (t x 1000 in float32) and every low-noise one below; each side's draws follow the whole
    schedule's distribution there (its quantiles match rejection sampling's)."""
    cfg = TrainConfig(timesteps=mode)
    dynamic = scheduler_shift(SCHEDULER_CONFIG)  # Wan's fixed flow_shift 3
    full = sample_timesteps(cfg, 200_000, TOKENS, torch.Generator().manual_seed(0), dynamic)
    for window in ((BOUNDARY, 1.0), (0.0, BOUNDARY)):
        t = window_timesteps(cfg, 20_000, TOKENS, torch.Generator().manual_seed(1), window,
                             dynamic)
        steps = t.float() * 1000
        assert bool((steps >= 875).all()) if window[0] else bool((steps < 875).all())
        kept = full[(full >= window[0]) & (full < window[1])]
        q = torch.tensor([0.1, 0.5, 0.9])
        torch.testing.assert_close(torch.quantile(t, q), torch.quantile(kept, q), atol=6e-3,
                                   rtol=0)


def _tiny_experts() -> Experts:
    from difftune.families.wan.tiny import build_tiny_wan

    parts = build_tiny_wan("2.2-t2v-a14b")
    return Experts.of(families.spec("wan", "2.2-t2v-a14b").experts, parts, BOUNDARY, 1000)


def test_the_tiny_a14b_folder_has_the_released_boundary(tmp_path: Path) -> None:
    """The tiny A14B saved by WanPipeline is laid out as the released folder: its
    model_index.json's boundary_ratio is Wan 2.2 T2V A14B's 0.875 (not null), so a pipeline
    loaded from it switches experts where the real one does."""
    from diffusers import WanPipeline

    from difftune.families.wan.tiny import build_tiny_wan

    WanPipeline(**build_tiny_wan("2.2-t2v-a14b")).save_pretrained(str(tmp_path))
    assert WanPipeline.from_pretrained(str(tmp_path)).config.boundary_ratio == 0.875


def test_each_row_runs_the_expert_the_pipeline_would_run() -> None:
    experts = _tiny_experts()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 1, 4, 4, generator=gen)
    text = torch.randn(3, 7, experts.config.text_dim, generator=gen)
    steps = torch.tensor([950.0, 500.0, 875.0])  # 875 itself is the high-noise expert's
    with torch.no_grad():
        out = experts(hidden_states=x, timestep=steps, encoder_hidden_states=text)[0]
        for row, part in enumerate(("transformer", "transformer_2", "transformer")):
            alone = experts.expert(part)(hidden_states=x[row:row + 1],
                                         timestep=steps[row:row + 1],
                                         encoder_hidden_states=text[row:row + 1],
                                         return_dict=False)[0]
            torch.testing.assert_close(out[row:row + 1], alone, rtol=1e-5, atol=1e-6)


def test_a_sample_runs_both_experts() -> None:
    """The family's pipeline holds both experts and switches at the boundary: a 4-step
    sample calls the high-noise expert first, then the low-noise one."""
    family = families.get("wan", "2.2-t2v-a14b")
    policy = PrecisionPolicy.from_config(PrecisionConfig(mixed="no"), torch.device("cpu"))
    comps = family.load(ModelConfig(family="wan", variant="2.2-t2v-a14b", flavor="tiny"), policy)
    pipe = family.pipeline(comps)
    assert pipe.config.boundary_ratio == BOUNDARY
    calls: list[str] = []
    for part in ("transformer", "transformer_2"):
        getattr(pipe, part).register_forward_pre_hook(lambda *_, p=part: calls.append(p))
    embeds = family.encode_text(comps, ["a red circle"])
    pipe(**family.pipeline_inputs(embeds, None, 1.0, 1.0), height=16, width=16,
         num_inference_steps=4, generator=torch.Generator().manual_seed(0), output_type="np")
    assert calls[0] == "transformer" and calls[-1] == "transformer_2"
    assert calls == sorted(calls)  # one switch, at the boundary


def test_keep_best_keeps_each_experts_file(tmp_path: Path) -> None:
    """A pair of candidates becomes `<name>-best_high_noise` / `_low_noise` together."""
    from difftune.config.keep_best import Measure
    from difftune.train.best import BestKeeper

    keeper = BestKeeper(Measure("val_loss"), tmp_path, "lora", None,
                        ("_high_noise", "_low_noise"))

    def save(step: int, path: Path) -> Path:
        for suffix in keeper.suffixes:
            path.with_name(f"{path.stem}{suffix}.safetensors").write_text(str(step))
        return path

    for step, loss in ((1, 2.0), (2, 1.0), (3, 3.0)):
        keeper.candidate(step, save)
        keeper.record(step, {"val_loss": loss})
    for suffix in ("_high_noise", "_low_noise"):
        assert (tmp_path / f"lora-best{suffix}.safetensors").read_text() == "2"
    assert not list(keeper.candidates.glob("*"))


def test_only_the_running_expert_is_on_the_device_and_both_loras_always_are() -> None:
    """Off the CPU (the meta device stands in for an accelerator here; nothing comes back
    from it, so one arrival is shown): both experts start in host memory, the expert called
    arrives whole, the other's frozen weights stay in host memory, and both experts' LoRA
    parameters are on the device, where their optimizer states are made."""
    from difftune.adapters.lora import add_lora

    experts = _tiny_experts()
    add_lora(experts, [r"(?:transformer|transformer_2)\.blocks\.\d+\.attn1\.to_q"], 2, 2.0,
             0.0, 0)
    experts.keep_one_on(torch.device("meta"))
    experts.trained_to_device()

    def devices(part: str, trained: bool) -> set[str]:
        return {p.device.type for p in experts.expert(part).parameters()
                if p.requires_grad == trained}

    assert devices("transformer", False) == devices("transformer_2", False) == {"cpu"}
    assert devices("transformer", True) == devices("transformer_2", True) == {"meta"}
    x = torch.zeros(1, 16, 1, 4, 4, device="meta")  # called as the pipeline calls it
    experts.expert("transformer")(hidden_states=x, timestep=torch.ones(1, device="meta"),
                                  encoder_hidden_states=torch.zeros(1, 3, experts.config.text_dim,
                                                                    device="meta"))
    assert experts.resident == "transformer"
    assert devices("transformer", False) == {"meta"} and devices("transformer_2", False) == {"cpu"}


def test_both_experts_blocks_compile() -> None:
    """`train.compile` compiles the spec's `compile_blocks`: both experts' blocks, named by
    their paths in the two-expert module."""
    from difftune.families.base import blocks_of

    experts = _tiny_experts()
    blocks = blocks_of(experts, families.spec("wan", "2.2-t2v-a14b").compile_blocks)
    high, low = (experts.expert(p).blocks for p in ("transformer", "transformer_2"))
    assert blocks == [*high, *low]


def test_fp8_storage_keeps_both_experts_embedders_high() -> None:
    """The family's keep-high patterns reach each expert under its name in the two-expert
    module: both experts' condition embedders and output projections stay as they are."""
    from difftune.precision.lowbit import Fp8Linear, store_fp8

    experts = _tiny_experts()
    keep = families.spec("wan", "2.2-t2v-a14b").keep_high["denoiser"]
    store_fp8(experts, torch.float32, keep)
    for part in ("transformer", "transformer_2"):
        expert = experts.expert(part)
        assert isinstance(expert.blocks[0].attn1.to_q, Fp8Linear)
        assert type(expert.condition_embedder.time_proj) is torch.nn.Linear
        assert type(expert.proj_out) is torch.nn.Linear


def test_a_moved_boundary_moves_the_sides_and_the_samples_switch(tmp_path: Path) -> None:
    """`train.expert_boundary = 0.5`: the high-noise expert trains t >= 0.5, the low one
    below, in turns of `expert_switch_every`, and the sampling pipeline switches at 0.5."""
    from difftune.config import load_config
    from difftune.train import experts as turns_of
    from tests.unit.test_config import GOOD, write

    text = GOOD.replace('flavor = "tiny"', 'family = "wan"\nvariant = "2.2-t2v-a14b"\n'
                        'flavor = "tiny"').replace(
        "steps = 10", "steps = 10\nexpert_boundary = 0.5\nexpert_switch_every = 3")
    cfg = load_config(write(tmp_path, text))
    turns = turns_of.turns(cfg, families.spec("wan", "2.2-t2v-a14b"))
    assert turns is not None
    assert [turns.window(done) for done in (0, 2, 3, 5, 6)] == [
        (0.5, 1.0), (0.5, 1.0), (0.0, 0.5), (0.0, 0.5), (0.5, 1.0)]
    experts = _tiny_experts()
    turns_of.set_boundary(cfg, experts)
    assert experts.boundary == 500.0


def test_a_file_of_neither_expert_is_refused_naming_the_names(tmp_path: Path) -> None:
    """A LoRA whose header and name say no expert cannot be routed: the error names the
    pair's file names; a ComfyUI-style name alone routes it."""
    from safetensors.torch import save_file

    from difftune.errors import CheckpointError
    from difftune.train.experts import expert_part

    family = families.get("wan", "2.2-t2v-a14b")
    plain = tmp_path / "style.safetensors"
    save_file({"x": torch.zeros(1)}, str(plain))
    with pytest.raises(CheckpointError, match=r"\*_high_noise.safetensors \(high\)"):
        expert_part(family, plain)
    named = tmp_path / "style_low_noise.safetensors"
    save_file({"x": torch.zeros(1)}, str(named))
    assert expert_part(family, named) == "transformer_2"
