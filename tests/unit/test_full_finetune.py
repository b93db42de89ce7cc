"""Full fine-tuning pieces: config refusals, block selection, sharded files, fp32 masters."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from difftune.adapters.full import make_trainable, select
from difftune.adapters.full_files import save_folder
from difftune.config import load_config
from difftune.errors import ConfigError
from difftune.files.shards import index_path, read_sharded, write_sharded
from tests.unit.test_config import GOOD, write

FULL = GOOD + '\n[adapter]\ntype = "full"\n'


@pytest.mark.parametrize("extra, field", [
    ('\n[precision]\nmixed = "bf16"\ndenoiser = "fp8"\n', "precision.denoiser = \"fp8\""),
    ('\n[precision.quantize]\ndenoiser = "int8"\n', "precision.quantize.denoiser"),
    ('text_encoders = ["t5"]\n[precision]\nmixed = "bf16"\ntext_encoders = {t5 = "fp8"}\n',
     "t5 is trained in full"),
    ("blocks_to_swap = 1\n", "train.blocks_to_swap with adapter.type = \"full\""),
])
def test_full_finetune_refusals_at_load(tmp_path: Path, extra: str, field: str) -> None:
    text = FULL.replace("steps = 10", "steps = 10\n" + extra) if "swap" in extra else FULL + extra
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert field in str(err.value)


def test_train_blocks_only_with_full_and_lora_options_warned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match="adapter.train_blocks only applies"):
        load_config(write(tmp_path, GOOD + '\n[adapter]\ntrain_blocks = ["x"]\n'))
    with caplog.at_level(logging.WARNING, logger="difftune"):
        cfg = load_config(write(tmp_path, FULL + "rank = 8\n"))
    assert cfg.adapter.type == "full" and "adapter.rank is ignored" in caplog.text


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))
        self.out = torch.nn.Linear(4, 2)


def test_select_by_glob_and_fp32_masters() -> None:
    net = _Net().to(torch.bfloat16).requires_grad_(False)
    names = make_trainable(net, ["blocks.1", "out"])
    assert names == ["blocks.1.bias", "blocks.1.weight", "out.bias", "out.weight"]
    assert net.blocks[1].weight.dtype == torch.float32 and net.blocks[1].weight.requires_grad
    assert net.blocks[0].weight.dtype == torch.bfloat16 and not net.blocks[0].weight.requires_grad
    assert len(select(net, None)) == 8
    with pytest.raises(ConfigError, match=r"\['block.\*'\] match no module.*blocks.0"):
        select(net, ["blocks.*", "block.*"])


def test_sharded_write_reads_back_cast_per_shard(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.randn(64, 64) for i in range(5)}  # 16 KiB each in fp32
    files = write_sharded(tmp_path / "w.safetensors", tensors, torch.bfloat16, 20 << 10)
    assert len(files) == 4 and index_path(tmp_path / "w.safetensors") in files  # 3 shards
    back = read_sharded(tmp_path / "w.safetensors")
    assert all(torch.equal(back[k], v.to(torch.bfloat16)) for k, v in tensors.items())
    one = write_sharded(tmp_path / "one.safetensors", tensors)
    assert one == [tmp_path / "one.safetensors"]


def test_folder_loads_with_from_pretrained_in_the_save_dtype(tmp_path: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from transformers import CLIPTextModel

    from difftune.families.registry import get
    from difftune.config.sections import ModelConfig, PrecisionConfig
    from difftune.precision.policy import PrecisionPolicy

    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    comps = get("flux").load(ModelConfig(flavor="tiny"), policy)
    save_folder(comps.denoiser, tmp_path / "transformer", torch.bfloat16, max_bytes=64 << 10)
    assert index_path(tmp_path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path / "transformer")
    for k, v in comps.denoiser.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.to(torch.bfloat16)), k
    save_folder(comps.text_encoders["clip_l"], tmp_path / "text_encoder", torch.float32)
    clip = CLIPTextModel.from_pretrained(tmp_path / "text_encoder")
    ref = comps.text_encoders["clip_l"].state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in clip.state_dict().items() if k in ref)


def test_block_swap_of_a_trained_block_is_refused(tmp_path: Path) -> None:
    from difftune.memory.savers import refuse_trained_swap

    text = FULL + 'train_blocks = ["blocks.2"]\n'
    cfg = load_config(write(tmp_path, text.replace("steps = 10", "steps = 10\nblocks_to_swap = 1")))
    net = _Net()
    make_trainable(net, ["blocks.2"])
    refuse_trained_swap(cfg, [net.blocks[1]])  # a frozen block: fine
    with pytest.raises(ConfigError, match="would swap trained weights"):
        refuse_trained_swap(cfg, [net.blocks[1], net.blocks[2]])
