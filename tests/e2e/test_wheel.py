"""An installed wheel has what a source checkout has: the example run files the web app's
presets are made from, and the demo assets, read through importlib.resources. The wheel is built
from a copy of the checkout and installed into a fresh virtual environment (no downloads: its
dependencies are taken from the test environment's own site-packages)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Only what the build reads (pyproject.toml, README.md, the package) is copied.
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", "tests", "bench", "docs")
PROBE = """
import json, sys
from importlib import resources
import difftune
from difftune.ui.forms import presets
examples = resources.files("difftune") / "assets" / "examples"
made, _ = presets.build()
print(json.dumps({"file": difftune.__file__,
                  "examples": {p.name: p.read_text(encoding="utf-8") for p in examples.iterdir()},
                  "presets": [p.name for p in made],
                  "demo": (resources.files("difftune") / "assets" / "demo.toml").is_file()}))
"""


def test_wheel_install_has_the_presets(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, symlinks=True, ignore=SKIP)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("difftune-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    # The dependencies from this environment, after the new venv's own site-packages (where
    # difftune is); the shared environment's editable difftune is not on that path.
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert Path(got["file"]).is_relative_to(venv), got["file"]
    shipped = {p.name: p.read_text(encoding="utf-8") for p in (ROOT / "examples").iterdir()}
    assert got["examples"] == shipped
    assert "tiny-flux" in got["presets"] and len(got["presets"]) > len(shipped) // 2
    assert got["demo"]
