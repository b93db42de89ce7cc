"""The contract every family passes, through the Family protocol alone, on its tiny flavor.

Load, encode text and images, one training step that moves only the LoRA, a saved LoRA that
diffusers' own loader puts back into a fresh pipeline with identical denoiser outputs, and one
sample. A new family joins by being registered (`families.names()`); nothing here knows a
family's internals.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from difftune import families
from difftune.config import RunConfig, load_config
from difftune.families.base import Conditioning
from difftune.sample.runner import PromptSpec, SampleRunner
from difftune.train.checkpoint import CheckpointManager
from difftune.train.loop import param_groups
from difftune.train.optimizers.build import make_optimizer
from difftune.train.setup import Run, fill_caches, prepare
from difftune.train.step import batch_loss


def config(folder: Path, images: Path, family: str) -> RunConfig:
    """A tiny run of `family` training its denoiser and one text encoder (the first declared
    that can get a LoRA, if any)."""
    path = folder / "run.toml"
    path.write_text(textwrap.dedent(f"""
        [model]
        family = "{family}"
        flavor = "tiny"
        [adapter]
        rank = 4
        alpha = 4
        targets = "all_linear"
        [[datasets]]
        path = "{images.as_posix()}"
        resolution = 64
        min_side = 32
        max_side = 128
        [train]
        steps = 1
        batch_size = 2
        lr = 1e-2
        seed = 5
        device = "cpu"
        [save]
        dir = "{(folder / 'out').as_posix()}"
        dtype = "fp32"
        """), encoding="utf-8")
    return load_config(path)


@pytest.fixture(scope="module", params=families.names())
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        images: Path) -> Run:
    """A prepared run (model loaded, LoRA added, caches filled) of one family."""
    folder = tmp_path_factory.mktemp(f"contract_{request.param}")
    cfg = config(folder, images, request.param)
    refused = {n for n, _ in families.spec(request.param).text_encoder_lora_refused}
    first = [n for n in encoder_names(request.param) if n not in refused][:1]
    adapter = cfg.adapter.model_copy(update={"text_encoders": first})
    prepared = prepare(cfg.model_copy(update={"adapter": adapter}), show_progress=False)
    fill_caches(prepared, [], show_progress=False)
    return prepared


def encoder_names(family: str) -> list[str]:
    """The family's declared text-encoder names, in order."""
    return [s.name for s in families.get(family).text_encoders]


def test_encode_text_batches_and_matches_the_cache(run: Run) -> None:
    captions = ["a red circle", "a pink ring on a blue background"]
    with torch.no_grad():
        direct = run.family.encode_text(run.comps, captions)
        via_cache = run.texts.get(captions)
    assert direct.tensors and direct.tensors.keys() == via_cache.tensors.keys()
    for name, value in direct.tensors.items():
        assert value.shape[0] == 2 and torch.isfinite(value).all(), name
        # One caption at a time in the cache vs. a batch here: equal to float rounding.
        torch.testing.assert_close(value, via_cache.tensors[name].to(value), rtol=1e-4,
                                   atol=1e-5)


def test_encode_images(run: Run) -> None:
    pixels = torch.rand(2, 3, 64, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = run.family.encode_images(run.comps, pixels)
    assert latents.ndim == 4 and latents.shape[0] == 2 and torch.isfinite(latents).all()
    # Downscaled alike on both sides by the VAE's factor: 8, or 16 (Qwen-Image 2.1's VAE).
    scale = 64 // latents.shape[-2]
    assert scale in (8, 16) and latents.shape[-2:] == (64 // scale, 48 // scale)


def _frozen(run: Run) -> dict[str, torch.Tensor]:
    """Every weight that is not a LoRA weight, denoiser and text encoders."""
    modules = {"denoiser": run.comps.denoiser, **run.comps.text_encoders}
    return {f"{m}.{k}": v.detach().clone() for m, module in modules.items()
            for k, v in module.state_dict().items() if "lora_" not in k}


def test_one_training_step_moves_only_the_lora(run: Run) -> None:
    frozen = _frozen(run)
    groups = param_groups(run)
    params = [p for g in groups for p in g["params"]]
    # The denoiser LoRA and the trained text encoder's LoRA (where one can be trained).
    assert len(groups) == 1 + len(run.trained_encoders)
    before = [p.detach().clone() for p in params]
    opt = make_optimizer(groups, run.cfg.train)
    loss = batch_loss(run, [0, 1], [False, False], torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)
    loss.backward()
    for group in groups:
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in group["params"])
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert any(not torch.equal(b, p) for b, p in zip(before, params))
    after = _frozen(run)
    assert after.keys() == frozen.keys()
    assert all(torch.equal(frozen[k], after[k]) for k in frozen)


def _prediction(run: Run, comps: object) -> torch.Tensor:
    """The denoiser's output on a fixed input, text encoded by `comps`' own encoders."""
    gen = torch.Generator().manual_seed(1)
    latents = run.family.encode_images(comps, torch.zeros(1, 3, 32, 32))
    noisy = torch.randn(latents.shape, generator=gen)
    t = run.objective.draw(latents, gen).t
    embeds = run.family.encode_text(comps, ["a red circle"])
    cond = Conditioning(guidance=1.0, original_sizes=[(32, 32)], crops=[(0, 0)],
                        target_sizes=[(32, 32)])
    with torch.no_grad():
        return run.family.predict(comps, noisy, embeds, t, cond)


def test_saved_lora_reloads_in_diffusers_with_identical_outputs(run: Run,
                                                                tmp_path: Path) -> None:
    cfg = run.cfg.model_copy(update={"save": run.cfg.save.model_copy(update={"dir": tmp_path})})
    for module in (run.comps.denoiser, *run.comps.text_encoders.values()):
        module.eval()
    # Make sure the LoRA is not a no-op (B starts at zero): nudge every LoRA weight.
    with torch.no_grad():
        for p in [p for group in param_groups(run) for p in group["params"]]:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    path = CheckpointManager(cfg, run.family, run.comps, run.targets, {}).save_lora(1, final=True)
    ours = _prediction(run, run.comps)
    fresh = run.family.load(cfg.model, run.policy)
    base = _prediction(run, fresh)
    pipe = run.family.pipeline(fresh)
    pipe.load_lora_weights(str(path))  # diffusers' own loader
    theirs = _prediction(run, fresh)
    assert not torch.allclose(base, ours, atol=1e-3)
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)


def test_one_sample(run: Run, tmp_path: Path) -> None:
    runner = SampleRunner(run.family, run.comps, run.texts, run.cfg.sample, tmp_path, (64, 64),
                          run.policy)
    step = run.family.bucket_step
    spec = PromptSpec("a red circle", "blurry", step, 2 * step, 2, 0, 3.5, 2.0)
    paths = runner.run(1, [spec])
    assert len(paths) == 1 and paths[0].exists()
    assert Image.open(paths[0]).size == (step, 2 * step)


def test_text_encoders_reload_alone_as_loaded(run: Run) -> None:
    """`load_text_encoders` (used after unloading) gives the encoders `load` gave."""
    again = run.family.load_text_encoders(run.cfg.model, run.policy)
    fresh = run.family.load(run.cfg.model, run.policy).text_encoders
    assert again.keys() == fresh.keys() == {s.name for s in run.family.text_encoders}
    for name, module in again.items():
        assert not module.training and not any(p.requires_grad for p in module.parameters())
        a, b = module.state_dict(), fresh[name].state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
