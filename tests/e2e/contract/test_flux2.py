"""FLUX.2-only behaviour through the real CLI on the tiny flavors. klein (the default variant,
whose training paths test_training_paths runs): the LoRA layouts other trainers write read by
--init-lora, and the variant refusals. dev (its own text encoder, Mistral 3): a lighter pass,
training, exact resume, and its LoRA loaded by Flux2Pipeline."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from difftune import families
from difftune.cli import main
from difftune.config import ModelConfig, PrecisionConfig
from difftune.precision.policy import PrecisionPolicy

from ..conftest import (
    metrics_rows,
    pipeline_image,
    run_toml,
    stopped_and_resumed,
    train_cli,
    train_exit_code,
)

DEV = 'flavor = "tiny"\nvariant = "dev"'


def train(folder: Path, images: Path, *sets: str, **kw: object) -> Path:
    """A FLUX.2 run through the CLI; the output folder."""
    return train_cli(folder, images, *sets, family="flux2", **kw)


def outputs(out: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A run's losses and its saved LoRA."""
    return [r["loss"] for r in metrics_rows(out)], load_file(str(out / "lora.safetensors"))


def assert_same(a: Path, b: Path) -> None:
    """Bitwise equal losses and LoRA tensors."""
    (la, wa), (lb, wb) = outputs(a), outputs(b)
    assert la == lb
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _resume_matches(tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch,
                    sets: list[str], model: str = 'flavor = "tiny"') -> None:
    """A run stopped at step 3 and resumed equals an uninterrupted one, bit for bit."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = run_toml(tmp_path / "a", images, steps=6, family="flux2", model=model)
    b = run_toml(tmp_path / "b", images, steps=6, family="flux2", model=model)
    rows = stopped_and_resumed(a, b, monkeypatch, 3, *sets)
    assert rows[0] == rows[1]
    assert_same(tmp_path / "a" / "out", tmp_path / "b" / "out")


@pytest.mark.parametrize("sets, message", [
    (['adapter.text_encoders=["qwen3"]'], "'qwen3' of model.family = \"flux2\" cannot get a LoRA"),
    (['model.variant="schnell"'], "is not a variant of model.family = \"flux2\""),
])


def test_refusals(sets: list[str], message: str, tmp_path: Path, images: Path,
                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = run_toml(tmp_path, images, family="flux2")
    assert main(["train", str(cfg), "--no-progress", *[x for s in sets for x in ("--set", s)]]
                ) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "lora.safetensors").exists()


def test_init_lora_reads_the_other_trainers_layouts(trained: Callable[[str], Path],
                                                    images: Path, tmp_path: Path) -> None:
    """Our diffusers file, ai-toolkit's `diffusion_model.` PEFT names without alpha, and the
    kohya `lora_unet_` layout (BFL names, fused qkv) of the same LoRA start the same run."""
    ours = trained("flux2") / "lora.safetensors"
    tensors = load_file(str(ours))
    ai_toolkit = tmp_path / "ai_toolkit.safetensors"
    save_file({k.replace("transformer.", "diffusion_model.", 1): v for k, v in tensors.items()},
              str(ai_toolkit))
    family = families.get("flux2")
    kohya = tmp_path / "kohya.safetensors"
    save_file(family.lora_to_format(None, tensors, "kohya", 4, 4.0), str(kohya))
    losses = []
    for name, init in (("ours", ours), ("ai_toolkit", ai_toolkit), ("kohya", kohya),
                       ("fresh", None)):
        (tmp_path / name).mkdir()
        cfg = run_toml(tmp_path / name, images, steps=1, family="flux2")
        extra = ["--init-lora", str(init)] if init is not None else []
        assert train_exit_code(cfg, extra=extra) == 0
        losses.append(metrics_rows(tmp_path / name / "out")[0]["loss"])
    assert losses[0] == losses[1] != losses[3]
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)  # fused and split back: rounding


def test_dev_trains_resumes_and_its_lora_loads_in_flux2_pipeline(
        tmp_path: Path, images: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """dev's tiny flavor (Mistral 3 encoder, guidance embedding): exact resume, and the saved
    diffusers file loads in Flux2Pipeline with every tensor used and the output changed."""
    _resume_matches(tmp_path, images, monkeypatch, [], model=DEV)
    check = run_toml(tmp_path / "check", images, family="flux2", model=DEV)
    assert main(["check", str(check)]) == 0
    family = families.get("flux2", "dev")
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    pipe = family.pipeline(family.load(ModelConfig(family="flux2", flavor="tiny", variant="dev"),
                                       policy))
    assert type(pipe).__name__ == "Flux2Pipeline"
    before = pipeline_image(pipe, guidance_scale=2.0)
    file = tmp_path / "a" / "out" / "lora.safetensors"
    pipe.load_lora_weights(str(file))
    assert not torch.allclose(before, pipeline_image(pipe, guidance_scale=2.0), atol=1e-4)
    from peft import get_peft_model_state_dict

    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="default_0")
    assert {f"transformer.{k}" for k in loaded} == set(load_file(str(file)))


@pytest.mark.parametrize("kind", [[], ['adapter.type="lokr"', "adapter.rank=2"]],
                         ids=["lora", "lokr"])
def test_default_file_holds_every_module_for_every_reader(
        tmp_path: Path, images: Path, kind: list[str]) -> None:
    """all_linear in the default layout (issue 29): a plain LoRA is written in BFL's names
    under `diffusion_model.` (scale folded), a LoKr with the shared modulation layers under
    `lora_unet_<BFL name>`; `sample --lora` draws what the run drew with its own adapter, and
    `--init-lora` starts from exactly the trained weights (the modulation layers included)."""
    import numpy as np
    from PIL import Image

    from difftune.train.init_lora import load_init_lora

    from ..test_adapter_kinds import manager

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle --w 32 --h 32 --s 2 --d 5\n", encoding="utf-8")
    cfg = run_toml(tmp_path, images, steps=2, fmt=None, family="flux2", prompts=prompts)
    sets = ["sample.at_start=false", *kind]
    assert main(["train", str(cfg), "--no-progress", *[x for s in sets for x in ("--set", s)]]
                ) == 0
    out = tmp_path / "out"
    saved = load_file(str(out / "lora.safetensors"))
    modulation = ("diffusion_model.single_stream_modulation.lin.lora_A.weight" if not kind
                  else "lora_unet_single_stream_modulation_lin.alpha")
    assert modulation in saved
    assert all(k.startswith("diffusion_model.") for k in saved) or kind
    m = manager(cfg, *kind)
    load_init_lora(out / "lora.safetensors", m)
    trained = load_file(str(sorted((out / "checkpoints").glob("step-*"))[-1]
                            / "trainable.safetensors"))
    assert any("single_stream_modulation" in k for k in trained)
    got = m.trainable()
    for key, value in trained.items():
        torch.testing.assert_close(got[key].detach(), value, rtol=1e-5, atol=1e-7, msg=key)

    def image(folder: Path) -> np.ndarray:
        (found,) = sorted(folder.glob("*_00_*.png"))
        return np.asarray(Image.open(found), dtype=np.int16)

    assert main(["sample", str(cfg), "--prompts", str(prompts), "--out", str(tmp_path / "s"),
                 "--lora", str(out / "lora.safetensors")]) == 0
    assert np.abs(image(tmp_path / "s") - image(out / "samples")).max() <= 1


def test_default_file_loads_completely_in_diffusers(tmp_path: Path, images: Path) -> None:
    """Flux2KleinPipeline.load_lora_weights reads the default file (issue 29) with every
    trained module, the shared modulation layers included, at the trained update (alpha 8,
    rank 4: the scale is folded into the file)."""
    from ..conftest import tiny_pipeline
    from ..test_hostile_files import assert_same, diffusers_deltas, trained_deltas

    out = train(tmp_path, images, fmt=None, steps=2)
    assert all(k.startswith("diffusion_model.") for k in load_file(str(out / "lora.safetensors")))
    pipe = tiny_pipeline("flux2")
    pipe.load_lora_weights(str(out / "lora.safetensors"))
    want = trained_deltas(out, alpha=8)
    assert "transformer.double_stream_modulation_txt.linear" in want
    assert_same(diffusers_deltas(pipe, "transformer"), want)


def test_check_names_the_modules_a_reader_would_not_apply(
        tmp_path: Path, images: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default claims both readers only when it is so; save.format = "diffusers" with the
    shared modulation layers names them (ComfyUI skips them) in `check` and in the training
    log, and says which layout carries them all."""
    cfg = run_toml(tmp_path, images, fmt=None, family="flux2")
    assert main(["check", str(cfg)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "LoRA file format" in x)
    assert "original (the flux2 default: the layout ComfyUI and diffusers both read fully" in line
    assert main(["check", str(cfg), "--set", 'save.format="diffusers"']) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "LoRA file format" in x)
    assert ("ComfyUI would not apply double_stream_modulation_img.linear, "
            "double_stream_modulation_txt.linear, single_stream_modulation.linear") in line
    assert 'save.format = "original" carries every trained module to both readers' in line
    out = train(tmp_path / "run", images, steps=1)  # save.format = "diffusers"
    log = (out / "difftune.log").read_text(encoding="utf-8")
    assert "ComfyUI would not apply double_stream_modulation_img.linear" in log


def test_original_format_is_refused_where_not_written(tmp_path: Path, images: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """save.format = "original" is FLUX.2's: another family refuses it at load (exit 2),
    naming the formats it writes."""
    cfg = run_toml(tmp_path, images, fmt="original", family="sd3")
    assert main(["train", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert 'save.format = "original" is not written for model.family = "sd3"' in err
    assert '"diffusers", "kohya"' in err
