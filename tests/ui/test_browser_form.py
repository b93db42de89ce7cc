"""In a real browser, the new-run form: each field under a human label with its dotted key
small beside it and its help under it (on the page, not in a tooltip), each validation problem
beside the field it names, and every dataset, subset and embedding editable (items added,
edited and removed, not only the first)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.ui.browser import DEMO, UiProcess, wait_for
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


def test_labels_help_problems_and_a_second_dataset(served: UiProcess, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    toml = page.get_by_test_id("toml")
    try:
        page.goto(f"{served.url}/prepare?preset=tiny-flux")
        wait_for("the preset's TOML", lambda: "flavor" in toml.inner_text())
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
