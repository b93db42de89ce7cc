"""`difftune ui` started as a user starts it, on a job database it cannot use and on addresses
it cannot listen on: exit 2 with one message naming the thing, the database left as it was;
a database with unreadable rows starts and says which. The served app, as a browser elsewhere
and a large upload reach it: refused."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
import urllib.request
from contextlib import closing
from pathlib import Path
from typing import Callable, Iterator

import pytest

from difftune.ui.jobs.store import JobStore
from difftune.ui.server import check_address
from tests.ui.browser import UiProcess, _user_env, free_port

def _run_ui(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`difftune ui --root ROOT ARGS` to its end (60 s at most: a hang fails the test)."""
    return subprocess.run([sys.executable, "-m", "difftune", "ui", "--root", str(root), *args],
                          capture_output=True, text=True, timeout=60, env=_user_env(),
                          cwd=root)


def _with_jobs(root: Path, count: int = 12) -> Path:
    """A job database under `root` holding `count` jobs, all in its main file."""
    db = root / ".difftune-ui" / "jobs.sqlite"
    store = JobStore(db)
    for n in range(count):
        store.add("train", root / "a.toml", ["--set", f"train.steps={n}"], root / "runs" / "a",
                  "cpu")
    store.close()
    with closing(sqlite3.connect(db, isolation_level=None)) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db


def _other_tables(db: Path) -> None:
    db.unlink()
    with closing(sqlite3.connect(db, isolation_level=None)) as con:
        con.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, name TEXT)")


def _other_schema(db: Path) -> None:
    db.unlink()
    with closing(sqlite3.connect(db, isolation_level=None)) as con:
        con.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, command TEXT)")
        con.execute("INSERT INTO jobs (command) VALUES ('x')")


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "corrupt": (lambda db: db.write_bytes(bytes(range(256)) * (db.stat().st_size // 256)),
                "cannot be read (SQLite: file is not a database)"),
    "truncated": (lambda db: db.write_bytes(db.read_bytes()[:db.stat().st_size // 2]),
                  "cannot be read (SQLite: database disk image is malformed)"),
    "empty": (lambda db: db.write_bytes(b""), "is empty (0 bytes)"),
    "other tables": (_other_tables, "is not a difftune job database (it holds the tables "
                     "photos, and no jobs table)"),
    "other schema": (_other_schema, "holds a jobs table of another schema (no column verb"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_job_database_that_cannot_serve_stops_the_start(tmp_path: Path, case: str) -> None:
    db = _with_jobs(tmp_path)
    damage, problem = DAMAGE[case]
    damage(db)
    before = db.read_bytes()
    done = _run_ui(tmp_path, "--port", str(free_port()))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: the job database {db} {problem}")
    assert f"Move it aside (mv {db} {db}.bad)" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert db.read_bytes() == before and sorted(p.name for p in db.parent.iterdir()) == \
        ["jobs.sqlite", "ui.lock"]


@pytest.fixture()
def read_only_db(tmp_path: Path) -> Iterator[Path]:
    """A job database this user cannot write: its mode 0444, and for root (who writes any
    file regardless) the immutable attribute as well, taken off again afterwards."""
    db = _with_jobs(tmp_path)
    db.chmod(0o444)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(db)], check=True)
    yield db
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(db)], check=True)


def test_a_read_only_job_database_stops_the_start(tmp_path: Path, read_only_db: Path) -> None:
    before = read_only_db.read_bytes()
    done = _run_ui(tmp_path, "--port", str(free_port()))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: the job database {read_only_db} is read-only for "
                                  "this user")
    assert "Traceback" not in done.stderr and read_only_db.read_bytes() == before


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port 70000 is not a TCP port; give one from 1 to 65535"),
    (["--host", "no-such-host.invalid"], "--host 'no-such-host.invalid' is not an address of "
     "this machine"),
])
def test_an_address_the_app_cannot_listen_on_stops_the_start(tmp_path: Path, args: list[str],
                                                             message: str) -> None:
    done = _run_ui(tmp_path, *args)
    assert done.returncode == 2 and done.stderr.startswith(f"error: {message}")
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""


@pytest.mark.parametrize("host, port, message", [
    ("127.0.0.1", 0, "--port 0 is not a TCP port"),
    ("127.0.0.1", 65536, "--port 65536 is not a TCP port"),
    ("300.1.2.3", 8765, "--host '300.1.2.3' is not an address of this machine"),
    ("192.0.2.1", 8765, "--host '192.0.2.1' is not an address of this machine"),  # not ours
    ("::ffff:zz", 8765, "--host '::ffff:zz' is not an address of this machine"),
])
def test_addresses_checked_before_the_start(host: str, port: int, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_address(host, port)
    check_address("127.0.0.1", free_port())  # a free one passes


def test_a_port_in_use_stops_the_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = _run_ui(tmp_path, "--port", str(port))
    assert done.returncode == 2 and done.stderr == (
        f"error: --port {port} on --host 127.0.0.1 is in use by another program; pick another "
        "--port (or stop what listens there)\n")


def test_unreadable_rows_are_reported_and_the_app_refuses_other_sites(tmp_path: Path) -> None:
    db = _with_jobs(tmp_path, count=4)
    with closing(sqlite3.connect(db, isolation_level=None)) as con:
        con.execute("UPDATE jobs SET args = 'not json' WHERE id = 2")
        con.execute("UPDATE jobs SET state = NULL WHERE id = 3")
    ui = UiProcess(tmp_path).start()
    try:
        log = ui.log.read_text()
        assert (f"2 job(s) in the job database {db} cannot be read and are not listed "
                "(job 2: args is not a JSON list ('not json'); job 3: state is not text (None))"
                ) in log
        listed = json.load(urllib.request.urlopen(f"{ui.url}/api/jobs", timeout=10))
        assert [job["id"] for job in listed] == [4, 1]
        assert "cannot be read and are not listed" in \
            urllib.request.urlopen(f"{ui.url}/", timeout=10).read().decode()
        assert _post(ui.port, "/api/jobs/1/stop", {"Origin": "http://evil.example"})[0] == 403
        status, text = _post(ui.port, "/api/config/validate",
                             {"Content-Length": str(256 << 20)})
        assert status == 413 and "256.0 MiB" in text
        assert _post(ui.port, "/api/jobs/4/stop", {})[0] == 200  # a script, no Origin
    finally:
        ui.stop()


def _post(port: int, path: str, headers: dict[str, str]) -> tuple[int, str]:
    """POST to the app with `headers` (and a small JSON body unless a length is given)."""
    con = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        con.putrequest("POST", path)
        for key, value in {"Content-Type": "application/json", "Content-Length": "2",
                           **headers}.items():
            con.putheader(key, value)
        con.endheaders(b"{}")
        reply = con.getresponse()
        return reply.status, reply.read().decode()
    finally:
        con.close()
