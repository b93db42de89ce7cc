"""In a real browser, sample metrics on the run page (chart, and the figures of each measured
step beside the checkpoint saved there) and on the compare page (one chart for the chosen runs,
each sample card with its prompt's figures). The rows are what a run writes: the real
`measure` of the runs' saved samples (tiny random DINOv2 and CLIP), written by the Reporter."""

from __future__ import annotations

import html
import json
import re
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from difftune.config.metrics import MetricsConfig
from difftune.report.metrics import Reporter
from difftune.report.sample_metrics import measure, read_sample, reference
from difftune.report.scoring import Scorers
from tests.ui import tiny_run
from tests.ui.browser import DEMO, UiProcess, editable, shoot, wait_for


def _measured(run: Path, scorers: Scorers, copy_similarity: float = 0.95) -> None:
    """Append each sample event's metrics to the run's metrics.jsonl, as a run with
    [metrics] does (every sample a copy with a floor of -1)."""
    ref = reference(scorers, sorted(DEMO.glob("*.png")), run / "cache", copy_similarity)
    reporter = Reporter(run, tiny_run.STEPS, start_step=tiny_run.STEPS, tensorboard=False,
                        bar=False, append=True)
    try:
        for step in (0, tiny_run.STEPS):
            files = sorted((run / "samples").glob(f"step-{step:06d}_0*.png"))
            reporter.sample_metrics(step, measure(scorers, ref, [read_sample(p) for p in files]))
    finally:
        reporter.close()


def _as_expert_pair(run: Path, out: Path) -> None:
    """`run` as a Wan 2.2 A14B run would have saved it: each LoRA file as the pair of the
    high- and low-noise experts' files (the files' contents are not read by the ranking)."""
    shutil.copytree(run, out)
    cfg = json.loads((out / "config.resolved.json").read_text(encoding="utf-8"))
    cfg["model"].update(family="wan", variant="2.2-t2v-a14b")
    (out / "config.resolved.json").write_text(json.dumps(cfg), encoding="utf-8")
    for lora in [*out.glob("*.safetensors"), *out.glob("checkpoints/*/lora.safetensors")]:
        for expert in ("high", "low"):
            shutil.copy(lora, lora.with_name(f"{lora.stem}_{expert}_noise.safetensors"))
        lora.unlink()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, scorer_models: tuple) -> Any:
    root = tmp_path_factory.mktemp("ui-metrics")
    run = tiny_run.make(tmp_path_factory)
    scorers = Scorers.load(MetricsConfig(enabled=True, dino=scorer_models[0],
                                         clip=scorer_models[1]))
    for name in ("run-a", "run-b"):
        shutil.copytree(run, root / "runs" / name)
        _measured(root / "runs" / name, scorers, -1.0 if name == "run-b" else 0.95)
    _as_expert_pair(root / "runs" / "run-a", root / "runs" / "run-pair")
    ui = UiProcess(root).start()
    yield ui
    ui.stop()


def _series(page: Any, testid: str) -> list[dict]:
    return page.evaluate(f"""() => {{
        const el = document.querySelector('[data-testid="{testid}"]');
        return getElement(el).chart.getOption().series.map(s => ({{name: s.name,
                                                                  n: s.data.length}}));
    }}""")


def test_run_page_charts_and_lists_sample_metrics(served: UiProcess, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1400})
    try:
        page.goto(f"{served.url}/run?path=runs/run-a")
        table = page.get_by_test_id("sample-metrics-table")
        wait_for("the metrics table", lambda: table.is_visible() and "step-000004"
                 in table.inner_text())
        series = {s["name"]: s["n"] for s in _series(page, "sample-metrics-chart")}
        assert series == {"fidelity": 2, "nearest training image": 2, "CLIP score": 2}, series
        rows = table.locator("tbody tr").all_inner_texts()
        assert len(rows) == 2 and rows[0].split()[0] == "0" and "step-000004" in rows[1]
        shoot(page, "run-sample-metrics")
    finally:
        page.close()


def test_compare_page_shows_both_runs_metrics(served: UiProcess, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    try:
        page.goto(f"{served.url}/compare?runs=runs/run-a,runs/run-b")
        wait_for("both runs' figures", lambda: page.get_by_test_id("compare-metrics-1").count())
        names = [s["name"] for s in _series(page, "compare-metrics-chart")]
        assert {"runs/run-a · fidelity", "runs/run-b · fidelity"} <= set(names), names
        assert "fidelity" in page.get_by_test_id("compare-metrics-0").inner_text()
        shoot(page, "compare-sample-metrics")
    finally:
        page.close()


def test_rank_page_shows_the_clis_ranking_with_samples(served: UiProcess, browser: Any) -> None:
    from difftune.verbs.rank import rank

    root = served.root
    _, expected = rank([root / "runs" / "run-a", root / "runs" / "run-b"], "fidelity")
    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    try:
        page.goto(f"{served.url}/compare?runs=runs/run-a,runs/run-b")
        page.get_by_test_id("compare-rank").click()
        wait_for("the ranking", lambda: page.get_by_test_id("rank-entry-0").count())
        assert editable(page, "rank-by").input_value() == "fidelity"
        titles = [page.get_by_test_id(f"rank-title-{i}").inner_text()
                  for i in range(len(expected))]
        for title, e in zip(titles, expected):
            assert f"{Path(e.run).parent.name}/{Path(e.run).name} · step {e.step}" in title
            assert (f"fidelity = {e.score:.4f}" if e.score is not None
                    else "unmeasured") in title
        assert sum(e.score is not None for e in expected) == 2  # step 4 of each run
        wait_for("a sample shown", lambda: page.get_by_test_id("rank-sample-0-0").count())
        shoot(page, "rank")
        pair = re.compile(r"(\S+)_high_noise\.safetensors \+ \1_low_noise\.safetensors$")
        assert not pair.search(page.get_by_test_id("rank-files-0").inner_text())
        page.goto(f"{served.url}/rank?runs=runs/run-pair&by=fidelity")  # a two-expert run
        wait_for("the pair's ranking", lambda: page.get_by_test_id("rank-entry-0").count())
        files = [page.get_by_test_id(f"rank-files-{i}").inner_text() for i in range(2)]
        assert all(pair.search(f) for f in files), files  # both files of each save
        page.goto(f"{served.url}/rank?runs=runs/run-a&by=fidelty")
        assert "unknown metric 'fidelty'" in page.get_by_test_id("error").inner_text()
    finally:
        page.close()


def test_rank_page_marks_a_checkpoint_whose_samples_copy_a_training_image(
        served: UiProcess) -> None:
    """The page, as served over HTTP, says per checkpoint what `runs rank` says: run-b's
    samples are copies (floor -1), run-a's are not; with the nearest image and the figures."""
    from difftune.verbs.rank import rank

    runs = [served.root / "runs" / "run-a", served.root / "runs" / "run-b"]
    _, entries = rank(runs, "fidelity")
    measured = {Path(e.run).name: e for e in entries if e.step == tiny_run.STEPS}
    assert measured["run-b"].copying and not measured["run-a"].copying
    with urllib.request.urlopen(f"{served.url}/rank?runs=runs/run-a,runs/run-b&by=fidelity",
                                timeout=60) as answer:
        page = html.unescape(answer.read().decode())
    for e in measured.values():
        c = e.closest
        assert c is not None and c["nearest"] in {p.name for p in DEMO.glob("*.png")}
        line = (f"{'copying' if e.copying else 'not copying'}: {c['sample']} has similarity "
                f"{c['similarity']:.4f} to training image {c['nearest']} (its copy floor "
                f"{c['floor']:.4f})")
        assert json.dumps(line)[1:-1] in page, line


def test_sweep_page_lists_trials_and_opens_them_in_compare(served: UiProcess,
                                                          browser: Any) -> None:
    """The study table as `difftune sweep` writes it (sweep.json; its writer and the trials
    are tests/e2e/test_sweep.py's), its trials opened side by side."""
    import json

    runs = served.root / "runs"
    trials = [{"trial": i, "state": "complete", "params": {"train.lr": lr}, "value": 2.0 + i,
               "run_dir": str(runs / name), "best_step": 4,
               "best_file": str(runs / name / "demo-lora.safetensors")}
              for i, (name, lr) in enumerate((("run-a", 0.003), ("run-b", 0.01)))]
    (runs / "sweep.json").write_text(json.dumps({"metric": "val_loss", "trials": trials}))
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/sweep?path=runs")
        table = page.get_by_test_id("sweep-table")
        wait_for("the study table", lambda: "train.lr = 0.01" in table.inner_text())
        assert "judged by val_loss" in page.get_by_test_id("sweep-metric").inner_text()
        assert "step 4: demo-lora.safetensors" in table.inner_text()
        shoot(page, "sweep")
        page.get_by_test_id("sweep-compare").click()
        wait_for("both trials' samples", lambda: page.get_by_test_id("compare-sample-1").count())
        assert "/compare?runs=runs/run-a,runs/run-b" in page.url
    finally:
        page.close()
