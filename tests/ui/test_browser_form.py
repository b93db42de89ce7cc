"""In a real browser, the new-run form: each field under a human label with its dotted key
small beside it and its help under it (on the page, not in a tooltip), each validation problem
beside the field it names, and every dataset, subset and embedding editable (items added,
edited and removed, not only the first)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.ui.browser import DEMO, UiProcess, shoot, wait_for
from tests.ui.test_browser_journey import fill


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A root holding the demo images, served by `difftune ui`."""
    root = tmp_path_factory.mktemp("ui-form")
    shutil.copytree(DEMO, root / "demo")
    ui = UiProcess(root).start()
    yield ui
    ui.stop()


def _below(page: Any, upper: str, lower: str) -> bool:
    """Whether test id `lower` is laid out under test id `upper`, in the same column."""
    a = page.get_by_test_id(upper).bounding_box()
    b = page.get_by_test_id(lower).bounding_box()
    return b["y"] >= a["y"] + a["height"] - 1 and abs(b["x"] - a["x"]) < 40


def _prepare(served: UiProcess, browser: Any) -> tuple[Any, Any]:
    """A new page on /prepare with the tiny preset loaded, and its TOML view."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    toml = page.get_by_test_id("toml")
    page.goto(f"{served.url}/prepare?preset=tiny-flux")
    wait_for("the preset's TOML", lambda: "flavor" in toml.inner_text())
    return page, toml


def test_labels_help_problems_and_a_second_dataset(served: UiProcess, browser: Any) -> None:
    page, toml = _prepare(served, browser)
    try:
        fill(page, "field-datasets[0].subsets[0].path", str(served.root / "demo"))
        fill(page, "field-train.lr", "-1")
        problem = page.get_by_test_id("problem-train.lr")
        wait_for("the problem beside train.lr", lambda: "train.lr" in problem.inner_text())
        assert "greater than 0" in problem.inner_text()
        assert page.get_by_test_id("label-train.lr").inner_text() == "Learning rate"
        assert page.get_by_test_id("key-train.lr").inner_text() == "train.lr"
        help_ = page.get_by_test_id("help-train.lr")
        assert help_.is_visible() and help_.inner_text() == "Peak learning rate."
        assert _below(page, "field-train.lr", "help-train.lr")
        assert _below(page, "help-train.lr", "problem-train.lr")
        assert page.get_by_test_id("error").count() == 0  # every problem found its field
        fill(page, "field-train.lr", "0.001")
        wait_for("the problem to go", lambda: problem.inner_text() == "")

        page.get_by_test_id("add-datasets").click()
        second = "field-datasets[1].subsets[0].path"
        wait_for("the second dataset's card", lambda: page.get_by_test_id(second).count())
        required = page.get_by_test_id("problem-datasets[1].subsets[0].path")
        wait_for("its folder asked for", lambda: "datasets[1].subsets[0].path" in
                 required.inner_text())
        page.get_by_test_id("item-datasets[1]").scroll_into_view_if_needed()
        shoot(page, "prepare-datasets")
        fill(page, second, str(served.root / "demo"))
        fill(page, "field-datasets[1].resolution", "256")
        wait_for("the second dataset in the TOML",
                 lambda: toml.inner_text().count("[[datasets") >= 3 and "256" in toml.inner_text())
        wait_for("its problem to go", lambda: required.inner_text() == "")
        assert page.get_by_test_id("start").is_enabled()

        page.get_by_test_id("add-datasets[0].subsets").click()
        sub = "field-datasets[0].subsets[1].path"
        wait_for("a second subset of dataset 1", lambda: page.get_by_test_id(sub).count())
        fill(page, sub, str(served.root / "demo"))
        page.get_by_test_id("remove-datasets[1]").click()
        wait_for("the second dataset gone", lambda: page.get_by_test_id(second).count() == 0)
        text = toml.inner_text()
        assert "256" not in text and text.count("[[datasets.subsets]]") == 2
    finally:
        page.close()


def test_a_model_picked_fills_the_model_lines(served: UiProcess, browser: Any) -> None:
    """"Find models" lists a renamed single file and a diffusers folder with the family (and
    variant) their files tell; "Use" writes the model lines, a folder replacing a file."""
    from safetensors.torch import save_file

    from tests.ui.test_models import _denoiser, _save_folder, _tiny

    models = served.root / "models"
    models.mkdir(exist_ok=True)
    save_file(_denoiser(_tiny("flux2", "klein")), str(models / "mystery.safetensors"))
    _save_folder("qwen_image", "edit", _tiny("qwen_image", "edit"), models / "my-model")
    page, toml = _prepare(served, browser)
    try:
        page.get_by_test_id("find-models").click()
        rows = page.locator('[data-testid$="-path"][data-testid^="model-"]')
        wait_for("the scan", lambda: rows.count() >= 2)
        listed = {rows.nth(i).inner_text(): i for i in range(rows.count())}
        file_row, folder_row = listed["models/mystery.safetensors"], listed["models/my-model"]
        shoot(page, "model-picker")
        assert page.get_by_test_id(f"model-{file_row}-family").inner_text() == \
            "file · flux2 (klein)"
        assert page.get_by_test_id(f"model-{folder_row}-family").inner_text() == \
            "folder · qwen_image (edit)"
        page.get_by_test_id(f"model-{file_row}-use").click()
        wait_for("the file's lines", lambda: 'family = "flux2"' in toml.inner_text())
        text = toml.inner_text()
        assert 'variant = "klein"' in text and str(models / "mystery.safetensors") in text
        page.get_by_test_id("find-models").click()
        wait_for("the scan", lambda: rows.count() >= 2)
        page.get_by_test_id(f"model-{folder_row}-use").click()
        wait_for("the folder's lines", lambda: 'family = "qwen_image"' in toml.inner_text())
        text = toml.inner_text()
        assert 'variant = "edit"' in text and str(models / "my-model") in text
        assert "mystery.safetensors" not in text  # the folder replaced the single file
    finally:
        page.close()


def test_an_imported_toml_that_is_not_utf8_is_refused_in_place(
        served: UiProcess, browser: Any, tmp_path: Path) -> None:
    """A .toml in another encoding, imported through the page's upload: its error on the page
    naming the file and the first bad byte; the editor keeps the preset; a good file then loads."""
    page, toml = _prepare(served, browser)
    try:
        bad = tmp_path / "latin1.toml"
        bad.write_bytes('[train]\nlr = 1e-4 # caf\u00e9\n'.encode("latin-1"))
        files = page.get_by_test_id("import").locator("input[type=file]")
        files.set_input_files(str(bad))
        error = page.get_by_test_id("error")
        wait_for("the import's error", lambda: error.count() and "latin1.toml" in
                 error.first.inner_text())
        assert "is not UTF-8 text (byte 0xe9" in error.first.inner_text()
        assert "flavor" in toml.inner_text()  # the preset is still there
        good = tmp_path / "good.toml"
        good.write_text('[model]\nflavor = "tiny"\n\n[train]\nlr = 0.0042\n', encoding="utf-8")
        files.set_input_files(str(good))
        wait_for("the good file in the editor", lambda: "0.0042" in toml.inner_text())
    finally:
        page.close()
