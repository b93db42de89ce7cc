"""Fixtures of the UI tests: Debian's Chromium driven by Playwright, once per module."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.ui.browser import FLAGS, chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium from the system (never a downloaded one)."""
    from playwright.sync_api import sync_playwright

    path = chromium()
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=path, args=FLAGS)
        yield instance
        instance.close()
