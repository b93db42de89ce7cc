"""Textual inversion on every tiny family: only the new embeddings change, files UIs read,
live encoding of placeholder captions, fp16 output embeddings, sampling, pivotal tuning,
resume and --init-lora."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune import families
from difftune.adapters.embeddings import ExtendedEmbedding
from difftune.cli import main
from difftune.config import parse_config
from difftune.errors import ConfigError
from difftune.families.common import text
from difftune.report.metrics import Reporter
from difftune.sample.runner import SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.loop import Hooks, train
from difftune.train.setup import Run, fill_caches, prepare
from difftune.verbs.demo import demo_dir


def config(tmp: Path, family: str, kind: str = "input", adapter_type: str = "embedding",
           precision: dict | None = None, encoders: list[str] | None = None,
           steps: int = 3) -> object:
    step = max(32, families.spec(family).bucket_step)
    prompts = tmp / "p.txt"
    prompts.write_text(f"<sks> on a blue background --w {step} --h {step} --s 1\n")
    return parse_config({
        "model": {"family": family, "flavor": "tiny"},
        "precision": precision or {},
        "adapter": {"type": adapter_type, "rank": 2, "targets": "attention",
                    "embeddings": [{"name": "<sks>", "tokens": 2, "init": "a red circle",
                                    "kind": kind, "encoders": encoders}],
                    "embedding_lr": 5e-2},
        # Half the images say "<sks>": the others' captions stay cacheable.
        "datasets": [{"subsets": [
            {"path": str(demo_dir()), "caption_prefix": "<sks>", "repeats": 1},
            {"path": str(demo_dir())}], "resolution": 64, "min_side": 32, "max_side": 128,
            "buckets": False}],
        "train": {"steps": steps, "batch_size": 2, "lr": 1e-3, "device": "cpu"},
        "sample": {"prompts": str(prompts), "at_end": True},
        "save": {"dir": str(tmp / "out"), "dtype": "fp32"},
    }, tmp)


def frozen_state(run: Run) -> dict[str, torch.Tensor]:
    """Every weight that must not train (the base tables of the encoders included)."""
    modules = {"denoiser": run.comps.denoiser, "vae": run.comps.vae, **run.comps.text_encoders}
    return {f"{m}.{k}": v.detach().clone() for m, module in modules.items()
            for k, v in module.state_dict().items() if ".rows" not in k and "lora_" not in k}


def run_it(cfg: object) -> tuple[Run, list[float], CheckpointManager]:
    run = prepare(cfg, show_progress=False)
    fill_caches(run, [], show_progress=False)
    reporter = Reporter(cfg.save.dir, cfg.train.steps, bar=False)
    sampler = SampleRunner(run.family, run.comps, run.texts, cfg.sample,
                           cfg.save.dir / "samples", (64, 64), run.policy)
    ckpt = CheckpointManager(cfg, run.family, run.comps, run.targets, {}, run.embeddings)
    try:
        result = train(run, Hooks(reporter, ckpt, sampler))
    finally:
        reporter.close()
    return run, result.losses, ckpt


@pytest.mark.parametrize("family", families.names())
def test_textual_inversion_changes_only_the_new_embeddings(tmp_path: Path, family: str) -> None:
    refused = families.spec(family).embeddings_refused
    if refused:  # the family declares why its encoders cannot learn embeddings
        with pytest.raises(ConfigError, match=re.escape(refused)):
            config(tmp_path, family)
        return
    cfg = config(tmp_path, family)
    run = prepare(cfg, show_progress=False)
    before = frozen_state(run)
    start = {k: v.detach().clone() for k, v in run.embeddings.parameters().items()}
    run, losses, _ = run_it(cfg)  # a fresh prepare: the same seeds give the same weights
    assert all(torch.isfinite(torch.tensor(losses)))
    after = frozen_state(run)
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), "a base weight changed"
    params = run.embeddings.parameters()
    assert set(params) == {f"emb.{e}.input_rows" for e in families.spec(family).encoder_names}
    assert all(not torch.equal(start[k], p) for k, p in params.items())  # every new row moved
    saved = load_file(str(cfg.save.dir / "embeddings" / "sks.safetensors"))
    # ComfyUI/A1111 names ("clip_l", "clip_g", ...)
    assert set(saved) == set(families.spec(family).encoder_names)
    for name, vectors in saved.items():
        width = run.comps.text_encoders[name].get_input_embeddings().base.embedding_dim
        assert vectors.shape == (2, width)
    assert list((cfg.save.dir / "samples").glob("step-000003_00_sks-*.png"))  # sampled with it


def test_placeholder_captions_are_encoded_live_and_others_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, bool]] = []
    real = text.encode

    def spy(spec: object, model: object, tok: object, texts: list[str], *a: object,
            **k: object) -> dict[str, torch.Tensor]:
        calls.extend((spec.name, t, torch.is_grad_enabled()) for t in texts)
        return real(spec, model, tok, texts, *a, **k)

    monkeypatch.setattr(text, "encode", spy)
    cfg = config(tmp_path, "flux", encoders=["clip_l"], steps=6)
    run_it(cfg)
    live = [c for c in calls if "<sks>_0" in c[1]]
    assert live and all(name == "clip_l" for name, _, _ in live)
    assert any(grad for _, _, grad in live)  # with gradients while training
    plain = [c for c in calls if "sks" not in c[1] and c[0] == "clip_l"]
    assert len(plain) == len({t for _, t, _ in plain})  # cached: each plain caption once
    # T5 does not learn the placeholder: it reads "<sks>" as text, cached like any caption.
    t5 = [t for name, t, _ in calls if name == "t5" and "<sks>" in t]
    assert len(t5) == len(set(t5))


def test_fp16_output_embeddings_on_sdxl(tmp_path: Path) -> None:
    precision = {"mixed": "fp16", "text_encoders": "fp16"}
    cfg = config(tmp_path, "sdxl", kind="output", precision=precision)
    run = prepare(cfg, show_progress=False)
    start = {k: v.detach().clone() for k, v in run.embeddings.parameters().items()}
    assert all(v.dtype == torch.float32 for v in start.values())  # trained in fp32
    for encoder in run.comps.text_encoders.values():  # the encoders themselves stay fp16
        assert encoder.get_input_embeddings().base.weight.dtype == torch.float16
        assert all(p.dtype == torch.float16 for n, p in encoder.named_parameters()
                   if "rows" not in n)
    run, losses, _ = run_it(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))
    params = run.embeddings.parameters()
    assert set(params) == {"emb.<sks>.clip_l.output", "emb.<sks>.clip_g.output"}
    assert all(not torch.equal(start[k], p) for k, p in params.items())
    for encoder in run.comps.text_encoders.values():  # the input rows only mark positions
        table = encoder.get_input_embeddings()
        assert isinstance(table, ExtendedEmbedding) and not table.rows.requires_grad
    saved = load_file(str(cfg.save.dir / "embeddings" / "sks.safetensors"))
    assert set(saved) == {"clip_l_output", "clip_g_output"}


def test_fp8_text_encoders_with_input_embeddings(tmp_path: Path) -> None:
    cfg = config(tmp_path, "sd3", precision={"mixed": "bf16", "text_encoders": "fp8"})
    run, losses, _ = run_it(cfg)
    assert all(torch.isfinite(torch.tensor(losses)))
    for encoder in run.comps.text_encoders.values():  # the lookup table itself is never fp8
        assert encoder.get_input_embeddings().base.weight.dtype == torch.bfloat16


def _cli(cfg_path: Path, *args: str) -> int:
    return main(["train", str(cfg_path), "--no-progress", *args])


def test_pivotal_tuning_resume_and_init(tmp_path: Path, images: Path) -> None:
    """LoRA + embeddings: bundled in the LoRA file; an exact resume; --init-lora from it."""
    from .conftest import run_toml

    def toml(folder: Path) -> Path:
        folder.mkdir()
        path = run_toml(folder, images, steps=4)
        path.write_text(path.read_text().replace(
            '[[datasets]]', '[[adapter.embeddings]]\nname = "<sks>"\ntokens = 2\n'
            'init = "a red circle"\n\n[[datasets]]\ncaption_prefix = "<sks>"', 1)
            .replace('targets = "all_linear"', 'targets = "all_linear"\nembedding_lr = 0.05'))
        return path

    whole, parts = toml(tmp_path / "whole"), toml(tmp_path / "parts")
    assert _cli(whole, "--set", "save.every_n_steps=2") == 0
    lora = load_file(str(tmp_path / "whole" / "out" / "lora.safetensors"))
    assert {"bundle_emb.<sks>.clip_l", "bundle_emb.<sks>.t5"} <= set(lora)
    assert _cli(parts, "--set", "save.every_n_steps=2", "--set", "train.steps=2") == 0
    assert _cli(parts, "--set", "save.every_n_steps=2", "--resume", "latest") == 0
    rows = [[json.loads(r)["loss"] for r in (d / "out" / "metrics.jsonl").read_text().splitlines()]
            for d in (tmp_path / "whole", tmp_path / "parts")]
    assert rows[0] == rows[1]  # resumed bitwise, embeddings included
    again = load_file(str(tmp_path / "parts" / "out" / "lora.safetensors"))
    assert all(torch.equal(lora[k], again[k]) for k in lora)
    init = toml(tmp_path / "init")
    assert _cli(init, "--set", "train.steps=1", "--set", "train.lr=1e-12", "--set",
                "adapter.embedding_lr=1e-12", "--init-lora",
                str(tmp_path / "whole" / "out" / "lora.safetensors")) == 0
    start = load_file(str(tmp_path / "init" / "out" / "embeddings" / "sks.safetensors"))
    for encoder in ("clip_l", "t5"):  # the bundle went into the placeholder (lr ~ 0 after)
        torch.testing.assert_close(start[encoder], lora[f"bundle_emb.<sks>.{encoder}"],
                                   rtol=0, atol=1e-6)


def test_check_on_a_textual_inversion_config(tmp_path: Path, images: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    def toml(prefix: str) -> Path:
        path = tmp_path / "ti.toml"
        path.write_text(f"""
[model]
flavor = "tiny"
[adapter]
type = "embedding"
[[adapter.embeddings]]
name = "<sks>"
init = "a dog"
[[datasets]]
path = "{images.as_posix()}"
resolution = 64
min_side = 32
max_side = 128
caption_prefix = "{prefix}"
[train]
device = "cpu"
[save]
dir = "{(tmp_path / 'out').as_posix()}"
""")
        return path

    assert main(["check", str(toml("<sks>"))]) == 0
    out = capsys.readouterr().out
    assert "gradients flow into <sks> in clip_l, <sks> in t5" in out
    assert "placeholder <sks>: in 6 of 6 captions" in out
    assert main(["check", str(toml(""))]) == 0  # no caption uses the placeholder: said at once
    assert "placeholder <sks>: in 0 of 6 captions (none:" in capsys.readouterr().out
