"""Every verb on every LoRA file difftune writes: family x adapter kind x layout x target preset.

A cell is one family (every registered one), one adapter kind (LoRA; DoRA, LoCon, LoHa, LoKr),
one layout (each of the family's `formats` for LoRA; the LyCORIS layout, the only one, for the
others) and one target preset (each of the family's `presets`; with Conv2d layers too for the
LyCORIS kinds where the family has them). Each cell trains once through the real CLI (one step,
a 2-step sample before and after it, fp32 files so the file holds exactly what was trained),
and its file is shared by the verbs (a module-scoped fixture):
- `sample --lora FILE` writes the image the run itself sampled after its step (same prompt,
  seed and size; exactly, or for the LyCORIS layout, applied by the LyCORIS library, to 1 of
  255 on under 0.1% of the values), which differs clearly (by 4 of 255 or more) from the base
  model's (the run's sample before its step): the file's weights were applied, not just loaded;
- `train --init-lora FILE` starts a new run from the trained weights: its sample before its
  first step is that same image;
- `check` passes on the cell's run file.

Tiers: the default run trains a pairs covering subset (every pair of values of any two axes
in some cell, but family x kind; see `DEFAULT`), the FLUX.1 kohya `attention_mlp` LoRA of
`examples/tiny-lora.toml` first, and checks `sample --lora` and the LoRA tools on each: every family's file in each of its layouts, a family fact.
`--init-lora` and `check` take the same path for every family given the adapter kind and
layout, so by default they run on the 7 of those cells that cover every kind x layout pair and
every target preset (`SHARED`; a family registered later adds cells to DEFAULT, not to SHARED
unless it brings a layout or preset no earlier cell has). The other cells are `full_only`
(`pytest --full`). `test_shipped_runs_are_cells` ties the examples (and so the web
app's presets, made from them) to the grid: none writes a file of a cell the grid lacks.
"""

from __future__ import annotations

import textwrap
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from difftune import families
from difftune.cli import main
from difftune.families.common.family import FamilyBase

from .conftest import pairwise

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LYCORIS = "lycoris"
KINDS = ("lora", "dora", "locon", "loha", "lokr")
# The cell of examples/tiny-lora.toml (and of the web app's tiny preset): first by default.
TINY = ("flux", "lora", "kohya", "attention_mlp")


def layouts(family: str, kind: str) -> tuple[str, ...]:
    """The layouts a run of `kind` writes for `family`: the family's formats for a plain LoRA,
    the LyCORIS layout for every other kind (save.format is refused with them)."""
    return families.spec(family).formats if kind == "lora" else (LYCORIS,)


CELLS: list[tuple[str, str, str, str]] = [
    (family, kind, layout, preset)
    for family in families.names() for kind in KINDS for layout in layouts(family, kind)
    for preset in families.get(family).presets]


# Every pair of values of any two axes in some cell but family x kind (`conftest.pairwise`,
# greedy in this order: the tiny example's cell first, the same cells on every run). Which
# reader a file meets is chosen by family x layout, which is covered (every LyCORIS kind shares
# its family's one LyCORIS layout); all pairs would take 49 cells, about 90 s on a 2-core CPU.
DEFAULT = pairwise([TINY] + [c for c in CELLS if c != TINY], skip=((0, 1),))
# `train --init-lora` and `check` on a file take one path per adapter kind x layout (the
# family's own reader, `lora_from_format`, is the one `sample --lora` meets in every DEFAULT
# cell; `check` of each family is in the contract suite): by default the DEFAULT cells that
# cover every kind x layout pair and every target preset, whatever the family (7 cells today).
SHARED = pairwise(DEFAULT, skip=((1, 3), (2, 3)), ignore=(0,))


def cell_params(default: list[tuple[str, str, str, str]]) -> list[Any]:
    """Every cell as the `trained` fixture's parameter (the same objects in the same order for
    every test, so each cell trains once), `full_only` outside `default`."""
    return [pytest.param(c, id="-".join(c), marks=() if c in default else pytest.mark.full_only)
            for c in CELLS]


PARAMS, SHARED_PARAMS = cell_params(DEFAULT), cell_params(SHARED)


def run_file(folder: Path, data: Path, prompts: Path, cell: tuple[str, str, str, str],
             out: Path, steps: int = 1, at_end: bool = True) -> Path:
    """The cell's run file in `folder`: a rank-2 adapter of the cell's kind, targets and
    layout on the family's tiny flavor, one step at lr 5e-2 with alpha 32 (a step that shows
    in the image), samples before (and after) it, fp32 files written to `out`."""
    family, kind, layout, preset = cell
    adapter = {"dora": 'type = "lora"\ndora = true', "lora": 'type = "lora"'}.get(
        kind, f'type = "{kind}"')
    if kind in ("locon", "loha", "lokr") and families.spec(family).conv_targets:
        adapter += "\nconv_rank = 2"
    fmt = f'format = "{layout}"\n' if layout != LYCORIS else ""
    text = textwrap.dedent(f"""\
        [model]
        family = "{family}"
        flavor = "tiny"

        [adapter]
        {{adapter}}
        rank = 2
        alpha = 32
        targets = "{preset}"

        [[datasets]]
        path = "{data.as_posix()}"
        resolution = 64
        min_side = 32
        max_side = 128
        buckets = false

        [train]
        steps = {steps}
        batch_size = 1
        lr = 5e-2
        seed = 5
        device = "cpu"

        [sample]
        prompts = "{prompts.as_posix()}"
        at_start = true
        at_end = {str(at_end).lower()}

        [save]
        dir = "{out.as_posix()}"
        dtype = "fp32"
        """).replace("{adapter}", adapter) + fmt
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(text, encoding="utf-8")
    return path


def pixels(path: Path) -> np.ndarray:
    """A PNG's pixels as integers."""
    return np.asarray(Image.open(path).convert("RGB")).astype(int)


def sample_at(out: Path, step: int) -> Path:
    """A run's one sample image at `step`."""
    found = sorted((out / "samples").glob(f"step-{step:06d}_00_*.png"))
    assert len(found) == 1, f"{out}: samples {sorted(p.name for p in (out / 'samples').iterdir())}"
    return found[0]


@pytest.fixture(scope="module")
def cell_prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-step prompt at the smallest size every family samples (64: Qwen-Image's step)."""
    path = tmp_path_factory.mktemp("grid_prompts") / "prompts.txt"
    path.write_text("a red circle on a blue background --w 64 --h 64 --s 2 --d 7\n",
                    encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            images: Path, cell_prompts: Path) -> dict[str, Any]:
    """One cell trained once: its cell, run file, output folder and LoRA file."""
    cell = request.param
    folder = tmp_path_factory.mktemp("grid_" + "_".join(cell))
    cfg = run_file(folder, images, cell_prompts, cell, folder / "out")
    assert main(["train", str(cfg), "--no-progress"]) == 0
    lora = folder / "out" / "lora.safetensors"
    assert lora.is_file()
    return {"cell": cell, "cfg": cfg, "out": folder / "out", "lora": lora, "folder": folder}


@pytest.mark.parametrize("trained", PARAMS, indirect=True)
def test_sample_applies_the_file(trained: dict[str, Any], tmp_path: Path) -> None:
    out = trained["out"]
    before, after = pixels(sample_at(out, 0)), pixels(sample_at(out, 1))
    change = np.abs(before - after).max()
    assert change >= 4, f"the step changed the image by {change} at most: the check is void"
    assert main(["sample", str(trained["cfg"]), "--lora", str(trained["lora"]),
                 "--out", str(tmp_path)]) == 0
    [written] = sorted(tmp_path.glob("*_00_*.png"))
    diff = np.abs(pixels(written) - after)
    # LyCORIS's modules (the LyCORIS-layout files) compute the update in another order of
    # float operations than peft did in training: 1 of 255 on a few values, against the
    # step's change of `change`. peft applies a plain LoRA as in training: exactly.
    lycoris = trained["cell"][2] == LYCORIS
    most, count = (1, diff.size // 1000) if lycoris else (0, 0)
    assert diff.max() <= most and (diff > 0).sum() <= count, (
        f"off by up to {diff.max()} on {(diff > 0).sum()} values; the step changed up to "
        f"{change}")


@pytest.mark.parametrize("trained", SHARED_PARAMS, indirect=True)
def test_init_lora_restores_the_weights(trained: dict[str, Any], images: Path,
                                        cell_prompts: Path) -> None:
    folder = trained["folder"] / "init"
    cfg = run_file(folder, images, cell_prompts, trained["cell"], folder / "out",
                   at_end=False)
    assert main(["train", str(cfg), "--no-progress", "--init-lora", str(trained["lora"])]) == 0
    assert np.array_equal(pixels(sample_at(folder / "out", 0)),
                          pixels(sample_at(trained["out"], 1)))


@pytest.mark.parametrize("trained", SHARED_PARAMS, indirect=True)
def test_check_passes(trained: dict[str, Any], tmp_path: Path,
                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(trained["cfg"]), "--set",
                 f"save.dir={(tmp_path / 'check').as_posix()}"]) == 0
    assert "check passed" in capsys.readouterr().out


# `difftune lora inspect`'s kind names of each adapter kind (a LoCon's linear modules are
# LoRA modules; its Conv2d ones, where the family has them, LoCon).
INSPECTED_KINDS = {"lora": {"LoRA"}, "dora": {"DoRA"}, "locon": {"LoRA", "LoCon"},
                   "loha": {"LoHa"}, "lokr": {"LoKr"}}


@pytest.mark.parametrize("trained", PARAMS, indirect=True)
def test_lora_tools_read_the_file(trained: dict[str, Any]) -> None:
    """`difftune lora inspect` names the cell's family and kind, and `verify` says ComfyUI
    drops exactly the keys its key map (tests/comfy_keymap.py) leaves unloaded."""
    from safetensors import safe_open

    from difftune.lora_tools.inspect import inspect_file
    from difftune.lora_tools.verify import verify_file

    from ..comfy_keymap import unmapped

    family, kind, _, _ = trained["cell"]
    report = inspect_file(trained["lora"])
    assert family in [report.family, *report.also_fits]
    assert set(report.kinds) <= INSPECTED_KINDS[kind] and report.kinds
    assert report.unresolved == [] and report.non_finite == {}
    comfy = verify_file(trained["lora"], family).results[0]
    with safe_open(str(trained["lora"]), "pt") as f:
        denoiser = [k for k in f.keys() if not k.startswith(("lora_te", "text_encoder"))]
    assert sorted(d.key for d in comfy.dropped) == unmapped(family, denoiser)
    assert comfy.applied == len(denoiser) - len(comfy.dropped)


def shipped_cell(path: Path) -> tuple[str, str, str, str] | None:
    """The cell an example run file writes its adapter files in (None: no adapter files)."""
    cfg = tomllib.loads(path.read_text(encoding="utf-8"))
    adapter, model = cfg.get("adapter", {}), cfg.get("model", {})
    kind = "dora" if adapter.get("dora") else adapter.get("type", "lora")
    if kind not in KINDS:
        return None
    family = model.get("family", "flux")
    layout = (cfg.get("save", {}).get("format") or families.get(family).default_format
              if kind == "lora" else LYCORIS)
    return family, kind, layout, adapter.get("targets", "attention")


def test_shipped_runs_are_cells() -> None:
    shipped = {p.name: shipped_cell(p) for p in sorted(EXAMPLES.glob("*.toml"))}
    assert shipped["tiny-lora.toml"] == TINY
    outside = {name: cell for name, cell in shipped.items()
               if cell is not None and cell not in CELLS}
    assert not outside



def written(family: str, fmt: str) -> bool:
    """Whether the family's code writes `fmt` (its class overrides the writer that refuses)."""
    cls = type(families.get(family))
    if fmt == "kohya":
        return cls.to_kohya is not FamilyBase.to_kohya
    return fmt == "diffusers" or cls.to_original is not FamilyBase.to_original


LAYOUTS = [(family, fmt) for family in families.names()
           for fmt in ("diffusers", "kohya", "original")]


def test_the_declared_layouts_are_those_written() -> None:
    """`spec.formats` (what the config, `check` and the web app's form accept, and the grid's
    layouts) is what the family writes: Z-Image and Qwen-Image accepted kohya, then refused
    to write it once the model had loaded."""
    assert [c for c in LAYOUTS if written(*c)] == [
        (family, fmt) for family, fmt in LAYOUTS if fmt in families.spec(family).formats]


@pytest.mark.parametrize(("family", "fmt"), [c for c in LAYOUTS if not written(*c)])
def test_check_refuses_a_layout_the_family_does_not_write(
        family: str, fmt: str, tmp_path: Path, images: Path, cell_prompts: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Refused when the config loads, before the model does."""
    cfg = run_file(tmp_path, images, cell_prompts, (family, "lora", fmt, "attention"),
                   tmp_path / "out")
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f'save.format = "{fmt}" is not written for model.family = "{family}"' in err
    assert "loading" not in err
