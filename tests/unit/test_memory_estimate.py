"""The memory estimate is one answer: the presets add exactly the savers it names for each
card (and differ where it says they must), each example fits its own card as written and its
header quotes the estimate, and the README's table is the generator's output. The arithmetic
itself is checked against figures worked by hand from the parameter counts."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import pytest

from difftune.families import registry
from difftune.memory import estimate
from difftune.ui.forms import presets, toml_io

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
FLUX = registry.spec("flux")
FLUX_DEV = FLUX.sizes[0]


def _values(preset: presets.Preset) -> dict:
    return toml_io.values(toml_io.parse(preset.toml))


def test_readme_table_is_the_generators_output() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- memory-table:start -->\n(.*?)<!-- memory-table:end -->", readme,
                      re.S)
    assert table is not None
    assert table[1] == presets.memory_table(), \
        "regenerate it: python -m difftune.ui.forms.presets"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_header_quotes_the_estimate(example: Path) -> None:
    line = presets.header_line(example)
    if example.name == presets.TINY:
        assert line is None
        return
    assert line is not None and line in example.read_text(encoding="utf-8").splitlines(), \
        f"the example's '# Memory:' line should read: {line}"


def test_presets_fit_their_card_and_differ_where_the_estimate_says() -> None:
    made, _ = presets.build()
    by_example: dict[str, dict[int, presets.Preset]] = {}
    for p in made:
        if p.estimate_gib is not None:
            by_example.setdefault(p.example, {})[p.gib] = p
    assert len(by_example) >= 10
    for name, cards in by_example.items():
        values, spec, size, head = presets.sized(ROOT / "examples" / name)
        own = cards[head.gpu]  # the example as written (its outputs next to the run file)
        written = (ROOT / "examples" / name).read_text(encoding="utf-8").splitlines()
        changed = [ln for ln in difflib.ndiff(written, own.toml.splitlines()) if ln[:1] in "+-"]
        assert own.savers == [] and len(changed) == 2 and changed[1] == '+ dir = "."', \
            f"{name} does not fit its own card as written: {changed}"
        for gib, preset in cards.items():
            peak = estimate.estimate(size, spec, estimate.Setup.from_values(_values(preset))).peak
            assert round(peak, 1) == preset.estimate_gib <= gib, (name, gib)
        sizes = sorted(cards, reverse=True)
        for big, small in zip(sizes, sizes[1:]):
            same = _values(cards[big]) == _values(cards[small])
            assert same == (cards[big].estimate_gib <= small), (name, big, small)


def test_tiny_preset_and_savers_shown() -> None:
    made, _ = presets.build()
    by_name = {p.name: p for p in made}
    assert by_name["tiny-flux"].note() == "CPU demo: no GPU memory needed"
    small = by_name["flux-dev-lora-12gib"]
    assert small.note().startswith(f"estimated peak {small.estimate_gib:.1f} GiB on the GPU "
                                   f"({estimate.LABEL}); adds int8 text encoders, 8-bit AdamW, "
                                   "block swap (")
    values = _values(small)
    assert values["precision.quantize.text_encoders"] == "int8"
    assert 0 < values["train.blocks_to_swap"] < FLUX_DEV.layers


def test_weights_and_swap_by_hand() -> None:
    """FLUX.1-dev: 11.90 B parameters are 22.17 GiB in bf16, half in int8; swapping 30 of 57
    blocks keeps 27 resident plus two in flight."""
    bf16 = estimate.Setup(denoiser="bf16", mixed="bf16", checkpointing=True)
    assert estimate.estimate(FLUX_DEV, FLUX, bf16).weights == pytest.approx(22.165, abs=1e-3)
    int8 = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(denoiser="int8", mixed="bf16"))
    assert int8.weights == pytest.approx(22.165 / 2, abs=1e-3)
    swapped = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(denoiser="bf16", swap=30))
    assert swapped.weights == pytest.approx(22.165 * 29 / 57, abs=1e-3)
    sdxl = registry.spec("sdxl")  # cannot swap: a swap setting changes nothing
    assert estimate.estimate(sdxl.sizes[0], sdxl, estimate.Setup(swap=10)).weights == \
        estimate.estimate(sdxl.sizes[0], sdxl, estimate.Setup()).weights


def test_activations_and_state_by_hand() -> None:
    """4096 image + 512 text tokens x 3072 wide x 34 bytes x 57 layers without checkpointing;
    with it, each layer's 2-byte input plus one layer's 34 bytes; AdamW keeps 8 bytes a
    parameter, 8-bit AdamW 2 (plus 8 for the fp32 weight and gradient)."""
    layer = 4608 * 3072 / 2 ** 30
    full = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(mixed="bf16"))
    assert full.activations == pytest.approx(layer * 34 * 57)
    ckpt = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(mixed="bf16", checkpointing=True))
    assert ckpt.activations == pytest.approx(layer * (2 * 57 + 34))
    fp32 = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(mixed="no"))
    assert fp32.activations == pytest.approx(2 * full.activations)
    lora = 11.90e9 * estimate.LORA_SHARE / 2 ** 30
    assert full.trained == pytest.approx(lora * 16)
    eight = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(optimizer="adamw8bit"))
    assert eight.trained == pytest.approx(lora * 10, rel=0.01)


def test_caching_phase_holds_the_encoders_with_the_denoiser() -> None:
    """The run loads every part before it caches, so the text encoders add to the resident
    denoiser then; while training they count only when they stay on the GPU."""
    s = estimate.Setup(denoiser="int8", encoders="bf16", mixed="bf16", checkpointing=True)
    e = estimate.estimate(FLUX_DEV, FLUX, s)
    assert e.caching == pytest.approx(e.weights + 4.88e9 * 2 / 2 ** 30 + 2.0)
    resident = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(
        denoiser="int8", encoders="bf16", mixed="bf16", checkpointing=True, text_resident=True))
    assert resident.training == pytest.approx(e.training + e.encoders)
    assert estimate.Setup.from_values({"cache.text": "none"}).text_resident
    assert estimate.Setup.from_values({"cache.offload": False}).text_resident


def test_fit_adds_only_savers_that_lower_the_peak() -> None:
    values = {"precision.mixed": "bf16", "precision.denoiser": "bf16",
              "precision.text_encoders": "bf16", "train.gradient_checkpointing": True}
    on24 = estimate.fit(values, FLUX_DEV, FLUX, 24)
    # int8 shrinks the resident weights, but the bf16 copy reaches the GPU first unless the
    # denoiser loads on the host, which block swap does: one swapped block is enough
    assert on24.fits and on24.savers == ["int8 denoiser",
                                         "block swap (1 of 57 blocks in host memory)"]
    assert estimate.fit(values, FLUX_DEV, FLUX, 80).savers == []
    sdxl = registry.spec("sdxl")
    tight = estimate.fit({}, sdxl.sizes[0], sdxl, 1)
    assert not tight.fits and not any("swap" in s for s in tight.savers)


def test_counted_sizes_match_the_release_or_come_from_counts() -> None:
    assert estimate.counted(FLUX, 11.90, 4.88, 57) is FLUX_DEV
    tiny = estimate.counted(FLUX, 0.0072, 0.0001, 4)
    assert tiny.name == "the loaded model" and tiny.layers == 4
    assert tiny.width == round((0.0072e9 / 4 / 12) ** 0.5)


def test_flatten_reads_a_config_as_form_paths() -> None:
    flat = estimate.flatten({"precision": {"denoiser": "bf16", "quantize": {"denoiser": "int8"}},
                             "datasets": [{"resolution": [512, 768]}], "train": {"steps": 3}})
    assert flat == {"precision.denoiser": "bf16", "precision.quantize.denoiser": "int8",
                    "datasets[0].resolution": [512, 768], "train.steps": 3}
    assert estimate.Setup.from_values(flat).resolution == 768
    assert estimate.Setup.from_values(flat).denoiser == "int8"


def test_full_fine_tune_fused_backward_and_ema_by_hand() -> None:
    """A full fine-tune's trained weights leave the frozen base's storage for fp32; fused
    backward keeps no gradient; an EMA on the GPU adds an fp32 copy (none in host memory)."""
    base = dict(denoiser="bf16", mixed="bf16", trained=1.42)
    lora = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(**base))
    full = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(**base, full=True))
    assert lora.weights - full.weights == pytest.approx(1.42e9 * 2 / 2 ** 30)
    assert full.trained == pytest.approx(1.42e9 * 16 / 2 ** 30, rel=0.01)
    fused = estimate.estimate(FLUX_DEV, FLUX, estimate.Setup(**base, full=True, fused=True))
    assert full.trained - fused.trained == pytest.approx(1.42e9 * 4 / 2 ** 30)
    values = {"adapter.type": "full", "train.fused_backward": True, "train.ema.enabled": True}
    assert estimate.Setup.from_values(values) == estimate.Setup(full=True, fused=True, ema=True)
    on_host = estimate.Setup.from_values({**values, "train.ema.cpu": True})
    assert not on_host.ema


def test_loading_holds_the_load_dtype_until_quantized() -> None:
    """Every part reaches the GPU in its load dtype and is quantized there (train/setup.py):
    bf16 before int8, the mixed dtype before fp8 storage; block swap loads the denoiser on
    the host, leaving only the text encoders to load on the GPU."""
    den, te = 11.90e9 * 2 / 2 ** 30, 4.88e9 * 2 / 2 ** 30
    values = {"precision.mixed": "bf16", "precision.denoiser": "bf16",
              "precision.text_encoders": "bf16", "precision.quantize.denoiser": "int8",
              "precision.quantize.text_encoders": "int8"}
    s = estimate.Setup.from_values(values)
    assert (s.denoiser, s.denoiser_load, s.encoders, s.encoders_load) == \
        ("int8", "bf16", "int8", "bf16")
    assert estimate.estimate(FLUX_DEV, FLUX, s).loading == pytest.approx(den + te + 1.0)
    fp8 = estimate.Setup.from_values({"precision.mixed": "fp16", "precision.denoiser": "fp8"})
    assert (fp8.denoiser, fp8.denoiser_load) == ("fp8", "fp16")
    swapped = estimate.Setup.from_values({**values, "train.blocks_to_swap": 1})
    assert estimate.estimate(FLUX_DEV, FLUX, swapped).loading == pytest.approx(te + 1.0)
