"""/api/datasets: a caption write only ever creates or replaces a caption file, never in the
app's own folder; the report reads no file (caption, image, dataset folder) outside the roots."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from .opened import flux_safetensors, opened_under
from .test_datasets_ui import _snapshot, client, folder  # noqa: F401 - the fixtures


@pytest.mark.parametrize("ext", [".png", "png", "jpg", ".JPEG", ".toml", ".json", ".txt\n",
                                 "." + "t" * 300, "../x", ".t/xt", ".t\\xt", ".", ""])
def test_a_caption_extension_that_is_no_captions_is_422(client: TestClient,  # noqa: F811
                                                        folder: Path, ext: str) -> None:
    (folder / "red_circle.toml").write_text('[save]\ndir = "x"\n')
    before = _snapshot(folder)
    answer = client.put("/api/datasets/caption", json={"image": "data/red_circle.png",
                                                       "text": "replaced", "caption_ext": ext})
    assert answer.status_code == 422, answer.text
    assert "caption_ext" in str(answer.json()["detail"])
    assert _snapshot(folder) == before
    browse = client.get("/api/datasets/browse", params={"path": "data", "caption_ext": ext})
    assert browse.status_code == 422 and "caption_ext" in str(browse.json()["detail"])


def test_a_caption_extension_of_captions_is_written(client: TestClient,  # noqa: F811
                                                    folder: Path) -> None:
    answer = client.put("/api/datasets/caption", json={"image": "data/red_circle.png",
                                                       "text": "new", "caption_ext": "caption"})
    assert answer.status_code == 200
    assert (folder / "red_circle.caption").read_text() == "new"


def test_a_caption_in_the_apps_folder_is_403(client: TestClient,  # noqa: F811
                                            folder: Path) -> None:
    app = folder.parent / ".difftune-ui"
    app.mkdir()
    shutil.copy(folder / "red_circle.png", app / "jobs.png")
    answer = client.put("/api/datasets/caption", json={"image": ".difftune-ui/jobs.png",
                                                       "text": "x"})
    assert answer.status_code == 403 and "the app's own folder" in answer.json()["detail"]
    assert not (app / "jobs.txt").exists()


def test_the_report_reads_no_caption_linked_outside(client: TestClient,  # noqa: F811
                                                   folder: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("secret, tags")
    shutil.copy(folder / "red_circle.png", folder / "linked.png")
    (folder / "linked.txt").symlink_to(outside)
    answer = client.get("/api/datasets/report", params={"path": "data", "resolution": 64})
    assert answer.status_code == 403, answer.text
    assert f"{folder / 'linked.txt'} is outside the folders" in answer.json()["detail"]
    assert "secret" not in answer.text


def test_the_report_of_a_run_file_with_datasets_outside_is_403(
        client: TestClient, folder: Path, tmp_path: Path) -> None:  # noqa: F811
    shutil.copytree(folder, tmp_path / "elsewhere")
    (folder.parent / "run.toml").write_text(
        f'[model]\nflavor = "tiny"\n\n[[datasets]]\npath = "{tmp_path / "elsewhere"}"\n'
        'resolution = 64\nmin_side = 64\n\n[save]\ndir = "out"\n')
    answer = client.get("/api/datasets/report", params={"path": "run.toml"})
    assert answer.status_code == 403, answer.text
    assert answer.json()["detail"].startswith(f"datasets.0.path = {tmp_path / 'elsewhere'} in")


def test_the_report_of_a_run_file_opens_no_model_file_outside(
        client: TestClient, folder: Path, tmp_path: Path) -> None:  # noqa: F811
    model = flux_safetensors(tmp_path / "outside" / "m.safetensors")  # its header names flux
    (folder.parent / "run.toml").write_text(
        f'[model]\nfamily = "wan"\ntransformer = "{model}"\n\n[[datasets]]\npath = "data"\n'
        '\n[save]\ndir = "out"\n')
    with opened_under(model.parent) as opened:
        answer = client.get("/api/datasets/report", params={"path": "run.toml"})
    assert answer.status_code == 403 and opened == []
    assert answer.json()["detail"].startswith(f"model.transformer = {model} in the run file")
