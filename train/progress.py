"""What a person watching a run sees: progress, library notes, MFU, the time left, the metrics log, the loss plot.

MFU (model FLOPs utilisation, PaLM appendix B) is ``flops_per_token * tokens_per_s / peak``
with the peak dense matmul rate of one chip for the compute dtype (float32
matmuls on NVIDIA GPUs run as TF32 under JAX's default precision).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from typing import Any, TextIO

import jax
from tqdm import tqdm

# Dense peak FLOP/s per chip (no sparsity), by substring of ``device.device_kind``.
PEAK_FLOPS: dict[str, dict[str, float]] = {
  "H200": {"bfloat16": 989e12, "float32": 494.5e12},
  "H100": {"bfloat16": 989e12, "float32": 494.5e12},
  "A100": {"bfloat16": 312e12, "float32": 156e12},
}


class _PlainLines(logging.Handler):
  """Each record as one plain line on the current ``sys.stderr`` (through tqdm, so a live bar stays whole)."""

  def emit(self, record: logging.LogRecord) -> None:
    try:
      msg = self.format(record)
      tqdm.write(f"warning: {msg}" if record.levelno >= logging.WARNING else msg, file=sys.stderr)
    except Exception:
      self.handleError(record)


def show_library_notes(info: bool = True) -> None:
  """Shows ``jax_dos``'s log records as plain lines on stderr: INFO and above, or with ``info=False`` warnings only.

  ``jax_dos`` logs and never prints (its notes, such as the calibration's,
  are INFO). The training script shows them here; they then no longer reach
  the root logger's handlers, which would print them a second time in their
  own format. Calling it again replaces the earlier setting.
  """
  logger = logging.getLogger("jax_dos")
  for handler in [h for h in logger.handlers if isinstance(h, _PlainLines)]:
    logger.removeHandler(handler)
  logger.addHandler(_PlainLines())
  logger.setLevel(logging.INFO if info else logging.WARNING)
  logger.propagate = False


def detect_peak_flops(compute_dtype: str, device: jax.Device | None = None) -> float | None:
  """Peak FLOP/s of ``device`` (default: the first) for ``compute_dtype``, or ``None`` if unknown (e.g. a CPU)."""
  device = device or jax.devices()[0]
  kind = getattr(device, "device_kind", "") or ""
  for name, peaks in PEAK_FLOPS.items():
    if name.lower() in kind.lower():
      return peaks[compute_dtype]
  return None


def metrics_rows(out: str) -> list[dict[str, Any]]:
  """The rows of the run's ``metrics.jsonl`` in ``out`` (none where it has none; a row cut short is left out)."""
  try:
    with open(os.path.join(out, "metrics.jsonl")) as f:
      lines = f.read().splitlines()
  except OSError:
    return []
  rows = []
  for line in lines:
    with contextlib.suppress(ValueError):
      rows.append(json.loads(line))
  return rows


class MetricsLog:
  """Appends one JSON object per line to ``path``.

  A fresh run truncates the file; a resumed run keeps the rows up to the
  resumed step and drops later ones (logged after the checkpoint it resumes
  from), so the file always reads as one run. ``enabled=False`` writes
  nothing (the processes of a job other than process 0).
  """

  def __init__(self, path: str, resume_step: int | None = None, enabled: bool = True):
    self.path, self.enabled, self.time_offset = path, enabled, 0.0
    if not enabled:  # another process of the job writes the log
      return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step] if resume_step is not None else []
    times = [r["time"] for r in keep if "time" in r]
    self.time_offset = max(times) if times else 0.0  # a resumed run's clock continues from the kept rows
    with open(path, "w") as f:
      for row in keep:
        f.write(json.dumps(row) + "\n")

  def write(self, row: dict[str, Any]) -> None:
    if not self.enabled:
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(row) + "\n")


def read_metrics(path: str) -> list[dict[str, Any]]:
  """The rows of a metrics log (empty if it does not exist)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


MATPLOTLIB_MISSING = "plotting needs matplotlib, an optional dependency: pip install -e '.[plot]'"


def plot_losses(rows: list[dict[str, Any]], path: str, title: str = "") -> None:
  """Training and validation loss against step, written to ``path`` (PNG, matplotlib's Agg backend).

  Raises ``ModuleNotFoundError`` naming the install command when matplotlib (the ``plot`` extra) is missing.
  """
  try:
    import matplotlib
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(MATPLOTLIB_MISSING) from e

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
  val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  if train:
    ax.plot(*zip(*train), lw=0.8, alpha=0.8, label="train")
  if val:
    ax.plot(*zip(*val), "o-", ms=3, label="validation")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# tqdm's own estimate of the time left counts the first step, which compiles: "22:00" for a run of 2 minutes. The
# bar shows the elapsed time and leaves the estimate to the postfix (Eta).
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


class PlainProgress:
  """Progress as one plain line per update, for a file or a pipe: the part of tqdm's interface the script uses.

  ``update`` prints ``step n/total [elapsed] key value, ...`` with the
  postfix last given to ``set_postfix``; ``write`` prints a line; ``disable``
  prints nothing.
  """

  def __init__(self, total: int, initial: int = 0, disable: bool = False, file: TextIO | None = None):
    self.total, self.n, self.disable, self.file = total, initial, disable, file
    self.postfix: dict[str, Any] = {}
    self.start = time.perf_counter()

  def set_postfix(self, postfix: dict[str, Any], refresh: bool = True) -> None:
    self.postfix = dict(postfix)

  def update(self, n: int = 1) -> None:
    self.n += n
    if n and not self.disable:
      fields = ", ".join(f"{k} {v}" for k, v in self.postfix.items())
      elapsed = fmt_duration(time.perf_counter() - self.start)
      self.write(f"step {self.n}/{self.total} [{elapsed}] {fields}".rstrip())

  def write(self, msg: str, file: TextIO | None = None) -> None:
    if not self.disable:
      print(msg, file=file or self.file or sys.stderr, flush=True)

  def close(self) -> None:
    pass


def make_bar(total: int, initial: int = 0, disable: bool = False, file: TextIO | None = None) -> tqdm | PlainProgress:
  """The run's progress display on ``file`` (default ``sys.stderr``): tqdm's bar on a terminal, else plain lines.

  A bar redraws itself with ``\\r``, which in a file or a pipe makes one long
  line; there :class:`PlainProgress` writes a line per update instead.
  """
  file = sys.stderr if file is None else file
  if not (getattr(file, "isatty", None) and file.isatty()):
    return PlainProgress(total, initial, disable, file)
  return tqdm(total=total, initial=initial, unit="step", disable=disable, dynamic_ncols=True, file=file,
              bar_format=BAR_FORMAT)  # fmt: skip


class Eta:
  """Time left to step ``total``, from the wall time per step since the first step after compilation.

  ``text`` is ``"--"`` until a step after :meth:`start` has been timed.
  Evaluations and checkpoints after that step count, as they will again.
  """

  def __init__(self, total: int):
    self.total = total
    self.mark: tuple[int, float] | None = None

  def start(self, step: int, now: float) -> None:
    """Called once the first (compiling) step has finished, at ``step``."""
    self.mark = (step, now)

  def seconds(self, step: int, now: float) -> float | None:
    if self.mark is None or step <= self.mark[0]:
      return None
    return (now - self.mark[1]) / (step - self.mark[0]) * max(0, self.total - step)

  def text(self, step: int, now: float) -> str:
    return fmt_duration(self.seconds(step, now))


def fmt_duration(seconds: float | None) -> str:
  """``None -> '--'``, ``75 -> '1:15'``, ``3725 -> '1:02:05'``."""
  if seconds is None:
    return "--"
  m, s = divmod(int(round(seconds)), 60)
  h, m = divmod(m, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_rate(x: float) -> str:
  """``12345.6 -> '12.3k'``."""
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}"


def bar_fields(row: dict[str, Any], eta: str, val_losses: dict[int, float]) -> dict[str, str]:
  """The progress bar's fields for a logged ``row`` of the metrics, with the time left (``eta``) and the newest
  validation loss of the training so far: none before its first validation pass (step 0's, the starting model's,
  is not repeated on every line until then)."""
  out = {"eta": eta, "loss": f"{row['loss']:.3f}"}
  passes = [s for s in val_losses if s > 0]
  if passes:
    out["val"] = f"{val_losses[max(passes)]:.3f}"
  if "grad_norm" in row:
    out["|g|"] = f"{row['grad_norm']:.3g}" + ("*" if row.get("clipped") else "")
  if row.get("tokens_per_s"):
    out["tok/s"] = fmt_rate(row["tokens_per_s"])
  out["mfu"] = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
  return out
