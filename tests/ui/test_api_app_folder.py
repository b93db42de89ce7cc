"""The app's own folder (`<first root>/.difftune-ui`: the job database, the lock) is never the
target of a save: a run file saved onto it, or through a link into it, is refused (403) and
the file is kept as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from .test_api_config import _tiny, forms_client  # noqa: F401 - the fixture


@pytest.mark.parametrize("path", [".difftune-ui/jobs.sqlite", ".difftune-ui/new.toml",
                                  ".difftune-ui", "runs/../.difftune-ui/jobs.sqlite",
                                  "linked.toml"])
def test_a_save_onto_the_apps_folder_is_403(forms_client: TestClient,  # noqa: F811
                                            tmp_path: Path, path: str) -> None:
    app = tmp_path / "root" / ".difftune-ui"
    app.mkdir()
    (app / "jobs.sqlite").write_bytes(b"SQLite format 3\x00")
    (tmp_path / "root" / "linked.toml").symlink_to(app / "jobs.sqlite")
    answer = forms_client.post("/api/config/save", json={
        "toml": _tiny(forms_client), "path": path, "overwrite": True})
    assert answer.status_code == 403, answer.text
    assert "the app's own folder" in answer.json()["detail"]
    assert (app / "jobs.sqlite").read_bytes() == b"SQLite format 3\x00"
    assert sorted(p.name for p in app.iterdir()) == ["jobs.sqlite"]
