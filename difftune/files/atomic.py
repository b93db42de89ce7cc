"""Writing a file so that no reader, and no rerun after a kill, ever sees it half-written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `data` to `path` through a hidden temporary file in the same folder
    (`.<name>.<random>.tmp`), synced, then renamed over `path`: a kill leaves either the old
    file or the new one, and at most a temporary file that `leftovers` finds. `mode`: the
    permission bits the file gets (None: mkstemp's 0o600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def leftovers(folder: Path, name_glob: str) -> list[Path]:
    """The temporary files a killed `write_atomically` left in `folder` for final names
    matching `name_glob`."""
    return sorted(folder.glob(f".{name_glob}.*.tmp"))
