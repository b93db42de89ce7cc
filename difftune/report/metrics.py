"""Progress bar, metrics.jsonl and TensorBoard scalars.

Reporting must never stop training: every write is guarded, and the first failure of each
sink is logged once as a warning, after which that sink is switched off.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

log = logging.getLogger("difftune")

# The sample metrics charted (TensorBoard `samples/<name>`, the web app).
SAMPLE_SCALARS = ("fidelity", "clip_score", "diversity", "nearest_similarity")


class Reporter:
    """Per-step reporting to the console bar, metrics.jsonl and TensorBoard."""

    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, bar: bool = True, append: bool = False,
                 every: int = 1) -> None:
        self.metrics_path = out_dir / "metrics.jsonl"
        self.total, self.every = total_steps, every
        # Kept open (line-buffered) for the run: reopening it every step costs more than the
        # write itself on small models.
        self._metrics = self._open_metrics(start_step if append else None)
        self.smoothed: float | None = None
        self.start_time = time.perf_counter()
        self.start_step = start_step
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                        dynamic_ncols=True, disable=not bar)
        self.writer = (self._tensorboard(out_dir / "tensorboard", start_step if append else None)
                       if tensorboard else None)
        self._broken: set[str] = set()
        self._write_lock = threading.Lock()  # sample metrics arrive from their own thread

    def _open_metrics(self, resumed_at: int | None) -> Any:
        """metrics.jsonl: a new run starts it afresh; a run resumed after step N keeps the
        rows up to N and appends, so steps redone after a crash appear once."""
        try:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            if resumed_at is None:
                return open(self.metrics_path, "w", encoding="utf-8", buffering=1)
            _keep_rows_until(self.metrics_path, resumed_at)
            return open(self.metrics_path, "a", encoding="utf-8", buffering=1)
        except OSError as err:  # reporting never stops training
            log.warning("metrics.jsonl is off: %s", err)
            return None

    def _tensorboard(self, path: Path, resumed_at: int | None) -> Any:
        """A TensorBoard writer; on a resume, events of steps after the checkpoint (written
        before a crash, redone now) are purged by TensorBoard itself."""
        try:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resumed_at is None else resumed_at + 1
            return SummaryWriter(log_dir=str(path), purge_step=purge)
        except Exception as err:  # reporting never stops training
            log.warning("TensorBoard logging is off: %s", err)
            return None

    def _guard(self, sink: str, fn: Any, *args: Any) -> None:
        if sink in self._broken:
            return
        try:
            fn(*args)
        except Exception as err:  # reporting never stops training
            self._broken.add(sink)
            log.warning("%s reporting failed and is now off (training goes on): %s", sink, err)

    def step(self, step: int, loss: float, lr: float, extra: dict[str, float] | None = None) -> None:
        """Record optimizer step `step` (1-based) with its loss and learning rate."""
        # Exponential moving average so the bar shows a readable trend, not per-step noise.
        if math.isfinite(loss):  # a skipped (non-finite) step does not poison the trend
            self.smoothed = loss if self.smoothed is None else 0.9 * self.smoothed + 0.1 * loss
        elapsed = time.perf_counter() - self.start_time
        rate = (step - self.start_step) / elapsed if elapsed > 0 else 0.0
        row = {"step": step, "loss": loss, "loss_smoothed": self.smoothed, "lr": lr,
               "it_per_s": rate, "time": elapsed, **(extra or {})}
        # train.log_every; a step with a validation loss is always written.
        if step % self.every == 0 or step == self.total or "val_loss" in row:
            row.update(gpu_memory())
            if self._metrics is not None:
                self._guard("metrics.jsonl", self._write_jsonl, row)
            if self.writer is not None:
                self._guard("tensorboard", self._write_tb, row)
        self._guard("progress", self._update_bar, row)

    def _write_jsonl(self, row: dict[str, Any]) -> None:
        with self._write_lock:
            self._metrics.write(json.dumps(row) + "\n")

    def sample_metrics(self, step: int, m: dict[str, Any]) -> None:
        """One sample event's metrics (report/sample_metrics.py): a metrics.jsonl row with the
        overall figures at the top level and the details under `sample_metrics`, and
        TensorBoard scalars `samples/<name>`. Called from the metrics thread."""
        top = {k: v for k, v in m.items() if k not in ("prompts", "samples")}
        row = {"step": step, "event": "samples", **top,
               "sample_metrics": {"prompts": m["prompts"], "samples": m["samples"]}}
        if self._metrics is not None:
            self._guard("metrics.jsonl", self._write_jsonl, row)
        if self.writer is not None:
            self._guard("tensorboard", self._write_sample_tb, step, top)

    def _write_sample_tb(self, step: int, top: dict[str, Any]) -> None:
        for key in SAMPLE_SCALARS:
            if isinstance(top.get(key), float):
                self.writer.add_scalar(f"samples/{key}", top[key], step)

    def _write_tb(self, row: dict[str, float]) -> None:
        # The loss's named parts (e.g. loss_preservation) on the steps that have them.
        parts = [k for k in row if k.startswith("loss_") and k != "loss_smoothed"]
        gpu = ("gpu_mem_gib",) if "gpu_mem_gib" in row else ()
        for key in ("loss", "loss_smoothed", "lr", "it_per_s", *gpu, *parts):
            self.writer.add_scalar(f"train/{key}", row[key], row["step"])
        if "val_loss" in row:
            self.writer.add_scalar("val/loss", row["val_loss"], row["step"])
            for t, value in row.get("val_loss_by_t", {}).items():
                self.writer.add_scalar(f"val/loss_t{t}", value, row["step"])

    def timestep_chart(self, step: int, by_t: dict[str, float]) -> None:
        """validation/loss_by_t-<step>.png: this evaluation's loss at each fixed timestep."""
        from difftune.report.plots import loss_by_timestep

        folder = self.metrics_path.parent / "validation"
        self._guard("validation chart", lambda: (folder.mkdir(exist_ok=True), loss_by_timestep(
            by_t, folder / f"loss_by_t-{step:06d}.png", f"validation loss by timestep, step {step}")))

    def _update_bar(self, row: dict[str, float]) -> None:
        smoothed = row["loss_smoothed"]
        self.bar.set_postfix(loss=f"{smoothed if smoothed is not None else math.nan:.4f}", lr=f"{row['lr']:.2e}",
                             refresh=False)
        self.bar.update(1)

    def image(self, tag: str, array: Any, step: int) -> None:
        """Add an HWC uint8 image to TensorBoard."""
        if self.writer is not None:
            self._guard("tensorboard", self.writer.add_image, tag, array, step, None, "HWC")

    def close(self) -> None:
        """Flush and close every sink."""
        self.bar.close()
        if self._metrics is not None:
            self._guard("metrics.jsonl", self._metrics.close)
        if self.writer is not None:
            self._guard("tensorboard", self.writer.close)


def gpu_memory() -> dict[str, float]:
    """`{"gpu_mem_gib": ...}`: the most GPU memory this process's tensors held since the last
    call (torch's peak allocated, reset here), in GiB; {} in a process that never used CUDA
    (a CPU run), where it costs one check."""
    import torch  # loaded already by any run that trains; kept off this module's import

    if not torch.cuda.is_initialized():
        return {}
    peak = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return {"gpu_mem_gib": round(peak, 3)}


def _keep_rows_until(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl with only its rows of steps up to `step` (atomically); lines cut
    short by a kill are dropped too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


class SilentReporter(Reporter):
    """The reporter of every process but rank 0 of a multi-process run: rank 0 reports the
    run's (averaged) figures; the others write and show nothing."""

    def __init__(self) -> None:  # no files, no bar
        pass

    def step(self, step: int, loss: float, lr: float, extra: dict[str, float] | None = None) -> None:
        """Nothing."""

    def image(self, tag: str, array: Any, step: int) -> None:
        """Nothing."""

    def timestep_chart(self, step: int, by_t: dict[str, float]) -> None:
        """Nothing."""

    def sample_metrics(self, step: int, m: dict[str, Any]) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""
