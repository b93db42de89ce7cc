"""/api/config: schema, presets, validation with the CLI's message, save and load under the
roots (traversal refused), on an app built for the test with a fake job queue."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api.config import router
from difftune.ui.context import UiContext
from difftune.ui.security import Roots


@dataclass
class FakeJob:
    id: int
    verb: str
    config: Path
    state: str = "queued"


@dataclass
class FakeQueue:
    """The JobQueue interface the pages use: submit, get, tail."""

    jobs: list[FakeJob] = field(default_factory=list)

    def submit(self, verb: str, config: Path, args: tuple[str, ...] = (),
               device: str = "default") -> FakeJob:
        self.jobs.append(FakeJob(len(self.jobs) + 1, verb, Path(config)))
        return self.jobs[-1]

    def get(self, job_id: int) -> FakeJob:
        return self.jobs[job_id - 1]

    def tail(self, job_id: int, lines: int = 200) -> list[str]:
        return []


@pytest.fixture()
def forms_client(tmp_path: Path) -> TestClient:
    root = tmp_path / "root"
    root.mkdir()
    ctx = UiContext(roots=Roots.of([root]), queue=FakeQueue())  # type: ignore[arg-type]
    app = FastAPI()
    app.include_router(router(ctx), prefix="/api")
    return TestClient(app)


def _tiny(client: TestClient) -> str:
    return client.get("/api/config/presets/tiny-flux").json()["toml"]


def test_schema_hides_what_does_not_apply(forms_client: TestClient) -> None:
    sdxl = forms_client.get("/api/config/schema", params={"family": "sdxl"}).json()
    paths = {f["path"] for s in sdxl["sections"] for f in s["fields"]}
    assert "train.lr" in paths and "model.t5" in sdxl["hidden"]
    lokr = forms_client.get("/api/config/schema",
                            params={"family": "flux", "adapter": "lokr"}).json()
    assert "adapter.factor" not in lokr["hidden"] and "model.t5" not in lokr["hidden"]
    assert lokr["choices"]["model.variant"] == ["base", "kontext"]


def test_presets_listed_and_served(forms_client: TestClient) -> None:
    listed = forms_client.get("/api/config/presets").json()
    names = [p["name"] for p in listed["presets"]]
    assert names[0] == "tiny-flux" and "sdxl-lora-12gib" in names
    assert any(r["example"] == "krea2-lora.toml" for r in listed["refused"])
    assert 'flavor = "tiny"' in _tiny(forms_client)
    assert forms_client.get("/api/config/presets/nope").status_code == 404


def test_validate_answers_with_the_cli_message(forms_client: TestClient,
                                               tmp_path: Path) -> None:
    text = _tiny(forms_client)
    ok = forms_client.post("/api/config/validate", json={"toml": text}).json()
    assert ok["ok"] and ok["message"] is None
    bad = forms_client.post("/api/config/validate",
                            json={"toml": text.replace("lr = 1e-3", "lr = -1"),
                                  "path": "runs/x/run.toml"}).json()
    assert not bad["ok"]
    assert bad["message"].endswith("- train.lr: Input should be greater than 0 (got -1)")
    assert bad["message"].startswith(f"{tmp_path / 'root' / 'runs/x/run.toml'}: 1 problem(s)")
    out = forms_client.post("/api/config/validate", json={"toml": text, "path": "/etc/x.toml"})
    assert out.status_code == 403


def test_save_writes_bytes_and_refuses_to_clobber(forms_client: TestClient,
                                                 tmp_path: Path) -> None:
    text = _tiny(forms_client)
    saved = forms_client.post("/api/config/save", json={"toml": text}).json()
    target = tmp_path / "root" / "runs" / "run" / "run.toml"  # save.name unset: "run"
    assert Path(saved["path"]) == target and target.read_bytes() == text.encode()
    assert saved["validation"]["ok"]
    again = forms_client.post("/api/config/save", json={"toml": text, "path": str(target)})
    assert again.status_code == 200  # the same bytes: nothing to clobber
    other = text.replace("steps = 100", "steps = 60")
    clash = forms_client.post("/api/config/save", json={"toml": other, "path": str(target)})
    assert clash.status_code == 409 and "already exists" in clash.json()["detail"]
    forced = forms_client.post("/api/config/save",
                               json={"toml": other, "path": str(target), "overwrite": True})
    assert forced.status_code == 200 and target.read_text() == other
    bad = forms_client.post("/api/config/save", json={"toml": "[x", "path": "a.toml"})
    assert bad.status_code == 422 and "not valid TOML" in bad.json()["detail"]


@pytest.mark.parametrize("where", ["../outside.toml", "/tmp/outside.toml",
                                   "runs/../../outside.toml"])
def test_paths_outside_the_roots_are_refused(forms_client: TestClient, where: str) -> None:
    text = _tiny(forms_client)
    assert forms_client.post("/api/config/save",
                             json={"toml": text, "path": where}).status_code == 403
    assert forms_client.get("/api/config/load", params={"path": where}).status_code == 403


def test_load_gives_text_and_form_values(forms_client: TestClient, tmp_path: Path) -> None:
    text = _tiny(forms_client)
    (tmp_path / "root" / "mine.toml").write_text(text, encoding="utf-8")
    got = forms_client.get("/api/config/load", params={"path": "mine.toml"}).json()
    assert got["toml"] == text
    assert got["values"]["train.steps"] == 100 and got["values"]["model.flavor"] == "tiny"
    assert "model.path" in got["hidden"]  # the tiny flavor needs no files
    missing = forms_client.get("/api/config/load", params={"path": "none.toml"})
    assert missing.status_code == 404
    form = forms_client.post("/api/config/form", json={"toml": text}).json()
    assert form["values"] == got["values"]
