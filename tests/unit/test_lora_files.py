"""LoRA files apart from any family's layout: refusals of unmapped or non-LoRA entries, pickle
and corrupt files, saving (dtype, metadata, no temp file, finiteness, file mode), the folded
alpha and CLIP-root naming every reader maps."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from difftune.adapters.formats import (
    CLIP_ROOT,
    diffusers_adapter_metadata,
    fold_scale,
    group_modules,
    load_lora_file,
    peft_state_to_diffusers,
    save_lora,
    with_clip_root,
)
from difftune.errors import CheckpointError, NonFiniteError
from difftune.families.flux.keys import diffusers_to_kohya, kohya_to_diffusers

RANK, ALPHA = 4, 8.0


def test_unmapped_module_is_an_error() -> None:
    state = {
        "transformer.transformer_blocks.0.attn.norm_q.lora_A.weight": torch.zeros(RANK, 16),
        "transformer.transformer_blocks.0.attn.norm_q.lora_B.weight": torch.zeros(16, RANK),
    }
    with pytest.raises(CheckpointError, match="norm_q"):
        diffusers_to_kohya(state, ALPHA, RANK)
    kohya = {
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(RANK, 8),
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, RANK),
    }
    with pytest.raises(CheckpointError, match="lora_te1"):
        kohya_to_diffusers(kohya)
    with pytest.raises(CheckpointError, match="double_blocks_0_img_attn_bogus"):
        kohya_to_diffusers(
            {
                "lora_unet_double_blocks_0_img_attn_bogus.lora_down.weight": torch.zeros(RANK, 8),
                "lora_unet_double_blocks_0_img_attn_bogus.lora_up.weight": torch.zeros(8, RANK),
            }
        )


def test_non_lora_peft_entries_are_refused() -> None:
    with pytest.raises(CheckpointError, match="lora_magnitude_vector"):
        peft_state_to_diffusers({"x_embedder.lora_magnitude_vector": torch.zeros(4)})
    named = peft_state_to_diffusers({"base_model.model.x_embedder.lora_A.weight": torch.zeros(1)})
    assert list(named) == ["transformer.x_embedder.lora_A.weight"]


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_pickle_files_are_refused(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"lora{suffix}"
    torch.save({"a": torch.zeros(1)}, path)
    with pytest.raises(CheckpointError, match="safetensors"):
        load_lora_file(path)


def test_save_lora_casts_writes_metadata_and_leaves_no_temp(tmp_path: Path) -> None:
    tensors = {"m.lora_down.weight": torch.randn(2, 3), "m.alpha": torch.tensor(12.3)}
    path = save_lora(tmp_path / "out" / "l.safetensors", tensors, {"difftune.step": "10"}, torch.bfloat16)
    loaded, metadata = load_lora_file(path)
    assert loaded["m.lora_down.weight"].dtype == torch.bfloat16
    assert loaded["m.alpha"].dtype == torch.float32 and loaded["m.alpha"].item() == pytest.approx(12.3)
    assert metadata == {"difftune.step": "10"}
    assert [p.name for p in path.parent.iterdir()] == ["l.safetensors"]
    with pytest.raises(TypeError):
        save_lora(tmp_path / "x.safetensors", tensors, {"n": 1}, None)  # type: ignore[dict-item]


def test_corrupt_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        load_lora_file(path)


def test_folded_scale_gives_the_same_delta_at_scale_one() -> None:
    """A diffusers file stores alpha/rank inside lora_B, so readers that apply no alpha
    (ComfyUI) and readers told alpha = rank (diffusers) get the trained delta."""
    g = torch.Generator().manual_seed(0)
    state = {"transformer.m.lora_A.weight": torch.randn(RANK, 6, generator=g),
             "transformer.m.lora_B.weight": torch.randn(5, RANK, generator=g)}
    folded = fold_scale(state, ALPHA / RANK)
    assert torch.equal(folded["transformer.m.lora_A.weight"], state["transformer.m.lora_A.weight"])
    want = group_modules(state, ALPHA)["transformer.m"].delta()
    torch.testing.assert_close(group_modules(folded, float(RANK))["transformer.m"].delta(), want)


def test_clip_root_renaming_reads_both_namings() -> None:
    """Files name CLIP modules under `text_model.`; a flattened transformers 5 CLIPTextModel
    has none. Either naming maps to either; other components and `text_projection` stay."""
    flat = "text_encoder.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    rooted = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    other = {"transformer.a.lora_A.weight": 1, "text_encoder_2.text_projection.lora_A.weight": 2}
    for name in (flat, rooted):
        state = {name: 0} | other
        roots = {"text_encoder": CLIP_ROOT, "text_encoder_2": CLIP_ROOT}
        assert with_clip_root(state, roots) == {rooted: 0} | other
        assert with_clip_root(state, {"text_encoder": ""}) == {flat: 0} | other


def test_target_modules_match_clip_modules_with_and_without_root() -> None:
    """diffusers strips `text_model.` before injecting into a flattened CLIPTextModel, so the
    metadata's target pattern must match the module both ways (and nothing else)."""
    state = {"text_encoder.text_model.encoder.layers.0.mlp.fc1.lora_A.weight": torch.zeros(1)}
    meta = diffusers_adapter_metadata(state, RANK, RANK, prefix="text_encoder")
    pattern = json.loads(meta["lora_adapter_metadata"])["text_encoder.target_modules"]
    assert re.fullmatch(pattern, "text_model.encoder.layers.0.mlp.fc1")
    assert re.fullmatch(pattern, "encoder.layers.0.mlp.fc1")
    assert not re.fullmatch(pattern, "encoder.layers.0.mlp.fc2")


def test_save_lora_refuses_non_finite_tensors(tmp_path: Path) -> None:
    """NaN/inf in the weights (diverged: lower train.lr) or only after the cast (too large for
    save.dtype): refused, named, and nothing written."""
    nan = {"m.lora_up.weight": torch.tensor([[1.0, math.nan]])}
    with pytest.raises(NonFiniteError, match=r"m\.lora_up\.weight: 1 NaN.*train\.lr"):
        save_lora(tmp_path / "a.safetensors", nan, {}, torch.bfloat16)
    big = {"m.lora_up.weight": torch.tensor([[1e6, 1.0]])}
    with pytest.raises(NonFiniteError, match=r"0 NaN, 1 inf.*save\.dtype"):
        save_lora(tmp_path / "b.safetensors", big, {}, torch.float16)
    assert not list(tmp_path.iterdir())
    save_lora(tmp_path / "c.safetensors", big, {}, torch.bfloat16)  # bf16 holds 1e6


def test_saved_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    """safetensors makes 0600 files; LoRAs must be readable by whoever the umask lets read."""
    old = os.umask(0o027)
    try:
        path = save_lora(tmp_path / "l.safetensors", {"m": torch.zeros(2)}, {}, None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
