"""The families' declared LoRA sources (`FamilySpec.lora_sources`) are facts of the models:
every denoiser module of the source that the reading family lacks is one its declaration names
(`lacks`), and every module both have has the same shape, on the tiny flavors and on the
released configs (meta device). Qwen-Image 2.1, which declares no source, has no module of
Qwen-Image's shape to read (its width differs), so its LoRAs are refused."""

from __future__ import annotations

import re

import pytest
import torch

from difftune import families
from difftune.config import ModelConfig, PrecisionConfig
from difftune.families import registry
from difftune.precision.policy import PrecisionPolicy

DECLARED = [(name, source) for name in registry.names()
            for source in registry.spec(name).lora_sources]


def _linear_shapes(model: torch.nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
    """`<prefix>.<module>`: weight shape, of every module with a weight."""
    return {f"{prefix}.{n}": tuple(m.weight.shape) for n, m in model.named_modules()
            if n and isinstance(getattr(m, "weight", None), torch.Tensor)}


def _tiny_denoiser(name: str) -> dict[str, tuple[int, ...]]:
    """The module shapes of family `name`'s tiny denoiser."""
    family = families.get(name)
    policy = PrecisionPolicy.from_config(PrecisionConfig(), torch.device("cpu"))
    comps = family.load(ModelConfig(family=name, flavor="tiny"), policy)
    return _linear_shapes(comps.denoiser, family.denoiser_prefix)


def _fits(source: dict[str, tuple[int, ...]], target: dict[str, tuple[int, ...]],
          lacks: tuple[tuple[str, str], ...]) -> None:
    """Source modules the target lacks are exactly the declared ones; shared ones agree."""
    declared = {m for m in source if any(re.fullmatch(p, m) for p, _ in lacks)}
    assert {m for m in source if m not in target} == declared
    assert not declared & set(target)
    assert {m: s for m, s in source.items() if m in target and target[m] != s} == {}


def test_a_family_declares_sources() -> None:
    assert DECLARED  # the tests below are not void


@pytest.mark.full_only  # the contract suite applies the tiny FLUX.1 LoRA to the tiny Chroma
@pytest.mark.parametrize(("name", "source"), DECLARED, ids=lambda v: getattr(v, "family", v))
def test_declared_sources_fit_on_the_tiny_flavors(name: str, source: object) -> None:
    _fits(_tiny_denoiser(source.family), _tiny_denoiser(name), source.lacks)  # type: ignore


def test_flux1_dev_fits_chroma1_hd_on_the_released_configs() -> None:
    """FLUX.1-dev's released transformer config (black-forest-labs/FLUX.1-dev
    transformer/config.json: the class defaults with guidance_embeds) and Chroma1-HD's."""
    from diffusers import ChromaTransformer2DModel, FluxTransformer2DModel

    from difftune.families.chroma.files import TRANSFORMER_CONFIG

    with torch.device("meta"):
        flux = FluxTransformer2DModel(guidance_embeds=True, pooled_projection_dim=768,
                                      joint_attention_dim=4096, num_layers=19,
                                      num_single_layers=38)
        chroma = ChromaTransformer2DModel(**TRANSFORMER_CONFIG)
    source = registry.spec("chroma").lora_sources[0]
    assert source.family == "flux"
    _fits(_linear_shapes(flux, "transformer"), _linear_shapes(chroma, "transformer"),
          source.lacks)


def test_qwen_image_21_has_no_module_of_qwen_images_shape() -> None:
    """Qwen-Image (60 blocks of 3072) and Qwen-Image 2.1 (32 of 4096), released configs: every
    linear layer both name differs in shape (only the per-head norms agree), so 2.1 reads no
    Qwen-Image LoRA (and declares none)."""
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    from difftune.families.qwen_image_21.files import TRANSFORMER_CONFIG as CONFIG_21

    with torch.device("meta"):
        old = _linear_shapes(QwenImageTransformer2DModel(), "transformer")
        new = _linear_shapes(QwenImage21Transformer2DModel(**CONFIG_21), "transformer")
    shared = {m for m in set(old) & set(new) if len(old[m]) == 2}  # the linear layers
    assert len(shared) > 100 and all(old[m] != new[m] for m in shared)
    assert not registry.spec("qwen_image_21").lora_sources


def test_read_across_renames_folds_the_alpha_and_names_what_it_leaves_out(
        caplog: pytest.LogCaptureFixture) -> None:
    """`read_across` on a declaration with a rename (no released pair needs one yet): the
    renamed modules, up factors times alpha / rank, and each module left out named once with
    its reason (declared, or absent from the model); a bad alpha is refused."""
    from pathlib import Path

    from difftune.adapters.across import read_across
    from difftune.errors import CheckpointError
    from difftune.families.specs import LoraSource

    source = LoraSource("flux", "a test declaration", renames=(("transformer.old.", "unet."),),
                        lacks=((r"transformer\.gone", "the model has none"),))
    state = {f"{m}.lora_{f}.weight": torch.ones(2, 2) for m in
             ("transformer.old.q", "transformer.gone", "transformer.extra") for f in "AB"}
    with caplog.at_level("WARNING", logger="difftune"):
        out = read_across("--lora", Path("f"), state, {"difftune.alpha": "4"}, source,
                          None, {"unet.q"})  # type: ignore[arg-type]
    assert out.keys() == {"unet.q.lora_A.weight", "unet.q.lora_B.weight"}
    assert torch.equal(out["unet.q.lora_B.weight"], torch.full((2, 2), 2.0))  # 4 / rank 2
    assert "1 flux module(s) not applied (the model has none): transformer.gone" in caplog.text
    assert ("1 flux module(s) not applied (this model has no module of that name): "
            "transformer.extra") in caplog.text
    with pytest.raises(CheckpointError, match="difftune.alpha metadata 'x' is not a positive"):
        read_across("--lora", Path("f"), state, {"difftune.alpha": "x"}, source,
                    None, {"unet.q"})  # type: ignore[arg-type]
