"""Shared test set-up: offline everywhere, quiet libraries."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from difftune.report.logs import quiet_libraries  # noqa: E402

quiet_libraries()
