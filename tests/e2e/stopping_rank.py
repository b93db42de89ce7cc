"""`difftune` whose rank 1 writes its process id to the file `$DIFFTUNE_TEST_PID_FILE`: run under
accelerate launch by test_distributed.py, which sends that one process a stop signal."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from difftune.cli import main

if os.environ.get("RANK") == "1":
    Path(os.environ["DIFFTUNE_TEST_PID_FILE"]).write_text(str(os.getpid()))
raise SystemExit(main(sys.argv[1:]))
