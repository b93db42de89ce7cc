"""Helpers of the browser tests: serve `difftune ui` as a real process, drive Debian's Chromium.

Chromium comes from the system (`.ci/run` installs Debian's package); Playwright drives it
through its `executable_path`, never downloading a browser of its own. Without Chromium the
tests skip, unless DIFFTUNE_REQUIRE_BROWSER is set (CI sets it), where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

DEMO = Path(__file__).resolve().parents[2] / "difftune" / "assets" / "demo"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    """The system's Chromium, or skip (fail under DIFFTUNE_REQUIRE_BROWSER)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    message = "no Chromium: install Debian's `chromium` package (.ci/run does)"
    if os.environ.get("DIFFTUNE_REQUIRE_BROWSER"):
        pytest.fail(message)
    pytest.skip(message)


def free_port() -> int:
    """A TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class UiProcess:
    """`difftune ui` serving `root` on a free port, as a user starts it."""

    def __init__(self, root: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.root, self.host = root, host
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"ui-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.printed = self.url

    def start(self, token_from_log: bool = False) -> "UiProcess":
        """Start the server and wait until it answers (30 s at most); with `token_from_log`,
        `printed` is the address it printed (token included), as reached from this machine."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "difftune", "ui", "--root", str(self.root),
                 "--port", str(self.port), "--host", self.host],
                stdout=out, stderr=subprocess.STDOUT, cwd=self.root, env=_user_env())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"difftune ui exited: {self.log.read_text()}")
            try:
                urllib.request.urlopen(f"{self.url}/api/jobs", timeout=2)
            except urllib.error.HTTPError:
                pass  # it answers (401 without the token)
            except OSError:
                time.sleep(0.3)
                continue
            if token_from_log:
                found = re.search(r"difftune ui: (http://\S+)", self.log.read_text())
                assert found, self.log.read_text()
                self.printed = re.sub(r"//[^/]+/", f"//127.0.0.1:{self.port}/", found.group(1))
            return self
        raise RuntimeError(f"difftune ui did not answer in 30 s: {self.log.read_text()}")

    def stop(self) -> None:
        """Stop the server as Ctrl-C does (its jobs run on: they are their own sessions)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def _user_env() -> dict[str, str]:
    """The environment a user's shell would give `difftune ui`: without pytest's variables,
    which make NiceGUI take itself for a test harness. One thread per process (the app's jobs
    inherit it): on a 2-core machine the browser, the app and a training job share the cores,
    and torch's spinning worker threads slow a job many times over when cores are short."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "NICEGUI_"))}
    return env | {"OMP_NUM_THREADS": "1"}


def shoot(page: Any, name: str) -> None:
    """Save what `page` shows as <folder>/<name>.png when DIFFTUNE_SCREENSHOTS names a folder
    (docs/ui.md's pictures: `DIFFTUNE_SCREENSHOTS=docs/ui pytest tests/ui/test_browser_*.py`)."""
    folder = os.environ.get("DIFFTUNE_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(folder) / f"{name}.png"))


def wait_for(what: str, test: Any, timeout: float = 60) -> Any:
    """Poll `test()` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = test()
        if value:
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def editable(page: Any, testid: str) -> Any:
    """The input or textarea a test id marks (Quasar puts it on the native element or on the
    field around it)."""
    field = page.get_by_test_id(testid)
    if field.evaluate("e => e.tagName") in ("INPUT", "TEXTAREA"):
        return field
    return field.locator("input, textarea").first
