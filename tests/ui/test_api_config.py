"""/api/config: schema, presets, validation with the CLI's message, save and load under the
roots (traversal refused), on an app built for the test with a fake job queue."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from difftune.ui.api.config import router
from difftune.ui.context import UiContext
from difftune.ui.jobs.queue import JobQueue
from difftune.ui.security import Roots

from .opened import flux_safetensors, opened_under


@dataclass
class FakeJob:
    id: int
    verb: str
    config: Path
    state: str = "queued"


@dataclass
class FakeQueue:
    """The JobQueue interface the pages use: submit, get, tail, run_dirs."""

    jobs: list[FakeJob] = field(default_factory=list)

    def submit(self, verb: str, config: Path, args: tuple[str, ...] = (),
               device: str = "default") -> FakeJob:
        self.jobs.append(FakeJob(len(self.jobs) + 1, verb, Path(config)))
        return self.jobs[-1]

    def get(self, job_id: int) -> FakeJob:
        return self.jobs[job_id - 1]

    def tail(self, job_id: int, lines: int = 200) -> list[str]:
        return []

    def run_dirs(self) -> set[Path]:
        return {job.config.parent for job in self.jobs}


@pytest.fixture()
def forms_client(tmp_path: Path) -> TestClient:
    root = tmp_path / "root"
    root.mkdir()
    ctx = UiContext(roots=Roots.of([root]), queue=FakeQueue())  # type: ignore[arg-type]
    return TestClient(_app(ctx))


def _app(ctx: UiContext) -> FastAPI:
    """An app serving only the /config routes over `ctx`."""
    app = FastAPI()
    app.include_router(router(ctx), prefix="/api")
    return app


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
    assert any(r["example"] == "flux-dev-full.toml" for r in listed["refused"])
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


def test_validate_reads_no_file_outside_the_roots(forms_client: TestClient,
                                                  tmp_path: Path) -> None:
    model = flux_safetensors(tmp_path / "outside" / "m.safetensors")  # its header names flux
    text = _tiny(forms_client).replace('family = "flux"\nflavor = "tiny"',
                                       f'family = "wan"\ntransformer = "{model}"')
    with opened_under(model.parent) as opened:
        out = forms_client.post("/api/config/validate", json={"toml": text}).json()
    assert not out["ok"] and opened == []
    assert "- model.transformer: " in out["message"] and "move the file" in out["message"]
    assert "flux" not in out["message"].replace(str(tmp_path), "")


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


def _left_over(root: Path) -> list[Path]:
    """Temporary files a save left behind."""
    return [p for p in root.rglob("*") if p.name.startswith(".run-")]


def test_odd_saves_are_refused_naming_the_problem(forms_client: TestClient,
                                                  tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "runs").mkdir()
    body = json.dumps({"toml": 'a = 1\nname = "\ud800"\n', "path": "runs/s.toml"})
    surrogate = forms_client.post("/api/config/save", content=body.encode(),  # as \ud800
                                  headers={"content-type": "application/json"})
    assert surrogate.status_code == 422
    assert "U+D800 at line 2, column 9, a lone surrogate" in surrogate.json()["detail"]
    assert not (root / "runs" / "s.toml").exists()
    for route, fields in (("form", {"toml": 'a = "\ud800"'}),
                          ("validate", {"toml": "a = 1", "path": "runs/\ud800.toml"}),
                          ("save", {"toml": "a = 1", "path": "runs/\ud800.toml"})):
        odd = forms_client.post(f"/api/config/{route}", content=json.dumps(fields).encode(),
                                headers={"content-type": "application/json"})
        assert odd.status_code in (403, 422) and ("lone surrogate" in odd.json()["detail"] or
                                                  "is not a valid path" in odd.json()["detail"])
    binary = root / "runs" / "image.toml"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\x00")
    for overwrite in (False, True):
        over = forms_client.post("/api/config/save", json={
            "toml": "a = 1\n", "path": "runs/image.toml", "overwrite": overwrite})
        assert over.status_code == 422 and "image.toml is not UTF-8 text (byte 0x89 at " \
            "offset 0), so it is not a run file" in over.json()["detail"]
    assert binary.read_bytes() == b"\x89PNG\r\n\x1a\n\xff\x00"
    (root / "runs" / "notes.txt").write_text("mine")
    for path in ("runs/notes.txt/run.toml", "runs/notes.txt/deeper/run.toml"):
        parent = forms_client.post("/api/config/save", json={"toml": "a = 1\n", "path": path})
        assert parent.status_code == 422
        assert f"{root / 'runs' / 'notes.txt'} is a file, not a folder" in \
            parent.json()["detail"]
    assert (root / "runs" / "notes.txt").read_text() == "mine"
    assert _left_over(root) == []


def test_loading_a_file_that_is_no_run_file_is_refused(forms_client: TestClient,
                                                       tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "big.toml").write_text("# " + "x" * (1 << 21) + "\n")  # valid TOML, 2 MiB
    big = forms_client.get("/api/config/load", params={"path": "big.toml"})
    assert big.status_code == 413 and "2.0 MiB, too large for a run file" in big.json()["detail"]
    (root / "latin1.toml").write_bytes('name = "caf\u00e9"\n'.encode("latin-1"))
    latin = forms_client.get("/api/config/load", params={"path": "latin1.toml"})
    assert latin.status_code == 422 and "is not UTF-8 text (byte 0xe9" in latin.json()["detail"]
    large = forms_client.post("/api/config/save", json={
        "toml": "# " + "x" * (1 << 21), "path": "runs/large.toml"})
    assert large.status_code == 413 and not (root / "runs" / "large.toml").exists()


def test_the_default_save_path_never_lands_in_a_used_folder(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    queue = JobQueue(root / ".difftune-ui" / "jobs.sqlite", Roots.of([root]))
    client = TestClient(_app(UiContext(roots=queue.roots, queue=queue)))
    try:
        text = _tiny(client)
        saved = [client.post("/api/config/save", json={"toml": text}).json()["path"]
                 for _ in range(2)]
        assert saved == [str(root / "runs" / "run" / "run.toml"),
                         str(root / "runs" / "run-2" / "run.toml")]  # the first now exists
        (root / "other.toml").write_text('[save]\ndir = "runs/run-3"\n')
        queue.submit("check", root / "other.toml")  # queued: its folder is not made yet
        third = client.post("/api/config/save", json={"toml": text}).json()["path"]
        assert third == str(root / "runs" / "run-4" / "run.toml")
    finally:
        queue.close()


def test_models_lists_what_the_roots_hold(forms_client: TestClient, tmp_path: Path) -> None:
    """GET /api/config/models: a file holding each family's marker tensors (under a name that
    says nothing) is that family's, with the model lines that pick it; other files unknown."""
    import torch
    from safetensors.torch import save_file

    from difftune.families import registry

    root = tmp_path / "root"
    for i, family in enumerate(registry.names()):
        spec = registry.variant_specs(family)[-1][1]
        names = [f"model.diffusion_model.{m}.weight" for m in spec.files.markers[0]]
        save_file({n: torch.zeros(1) for n in names}, str(root / f"m{i}.safetensors"))
    save_file({"encoder.conv_in.weight": torch.zeros(1)}, str(root / "vae.safetensors"))
    found = {Path(f["path"]).name: f for f in forms_client.get("/api/config/models").json()}
    for i, family in enumerate(registry.names()):
        key = registry.spec(family).files.singles[0][0]
        assert found[f"m{i}.safetensors"]["family"] == family
        assert found[f"m{i}.safetensors"]["fields"][f"model.{key}"] == str(root / f"m{i}.safetensors")
    assert found["vae.safetensors"]["family"] == "unknown"
