"""In a real browser, a LoRA file's page: its inspect and verify reports, and "convert to
comfy" and "resize" in one click each, writing beside the file; a refusal is shown, not
written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from difftune.adapters.formats import save_lora
from tests.lora_files import diffusers_lora, linear_modules
from tests.ui.browser import UiProcess, shoot, wait_for


def test_lora_page_reports_converts_and_resizes(tmp_path: Path, browser: Any) -> None:
    root = tmp_path / "root"
    (root / "loras").mkdir(parents=True)
    save_lora(root / "loras" / "z.safetensors", diffusers_lora("z_image", linear_modules(
        "z_image", r"attention\.to_[qk]$")), {})
    served = UiProcess(root).start()
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        page.goto(f"{served.url}/lora?path=loras/z.safetensors")
        report = page.get_by_test_id("lora-inspect")
        report.wait_for(timeout=120_000)
        assert "family:    z_image" in report.inner_text()
        assert "applies everything" in page.get_by_test_id("lora-verify").inner_text()
        result = page.get_by_test_id("lora-result")
        page.get_by_test_id("lora-convert-comfy").click()
        wait_for("the converted file", lambda: "wrote" in result.inner_text())
        assert (root / "loras" / "z-comfy.safetensors").is_file()
        page.get_by_test_id("lora-convert-kohya").click()
        wait_for("the refusal", lambda: "refused" in result.inner_text())
        assert "no kohya layout" in result.inner_text()
        assert not (root / "loras" / "z-kohya.safetensors").exists()
        page.get_by_test_id("lora-resize").click()
        wait_for("the resized file", lambda: "z-r8" in result.inner_text())
        assert (root / "loras" / "z-r8.safetensors").is_file()
        shoot(page, "lora")
    finally:
        page.close()
        served.stop()
