"""What the training loop records of its steps: each step's loss and gradient norm, and the rate between marks.

The loop hands each step's accelerator scalars to :class:`StepLog` and
reads them once a log interval (one wait, not one a step: a read waits behind
the step's copies). A step's row holds ``loss``, ``grad_norm`` (the global
norm of the step's mean gradient, before the clip) and ``clipped`` (whether
``clip_by_global_norm`` fired: ``grad_norm >= clip``, as ``jax_dos.clip_scale``
decides). :class:`Rate` gives tokens/s and MFU over the steps since its last
mark.
"""

from __future__ import annotations

import time
from typing import Any

import jax


class StepLog:
  """Each step's loss, gradient norm and whether the clip fired, read a log interval at a time."""

  def __init__(self, clip: float):
    self.clip = clip
    self.losses: dict[int, float] = {}
    self.grad_norms: dict[int, float] = {}
    self.fired = 0
    self._pending: list[tuple[int, Any, Any]] = []

  def add(self, step: int, loss: Any, grad_norm: Any) -> None:
    self._pending.append((step, loss, grad_norm))

  def flush(self) -> list[dict[str, Any]]:
    """The rows of the steps added since the last flush (``step``, ``loss``, ``grad_norm``, ``clipped``)."""
    values = jax.device_get([(loss, norm) for _, loss, norm in self._pending])
    rows = []
    for (step, _, _), (loss, norm) in zip(self._pending, values):
      row = {"step": step, "loss": float(loss)}
      if norm is not None:
        row["grad_norm"] = float(norm)
        row["clipped"] = bool(self.clip > 0 and float(norm) >= self.clip)
        self.grad_norms[step] = row["grad_norm"]
        self.fired += row["clipped"]
      self.losses[step] = row["loss"]
      rows.append(row)
    self._pending.clear()
    return rows

  def summary(self) -> str | None:
    """One line: in how many of the recorded steps the clip fired (``None`` without a clip or a step)."""
    if not self.clip or not self.grad_norms:
      return None
    n = len(self.grad_norms)
    return f"clip {self.clip:g} fired in {self.fired} of {n} steps ({100 * self.fired / n:.0f}%)"


class Rate:
  """Tokens/s and MFU over the steps between two marks.

  A mark is a step's return, when work of the steps before it may still run (an overlapped step's offloaded update,
  the accelerator's queue): each window then starts and ends with a step's work in flight, and measures the steady
  rate. After a point where nothing is in flight (:meth:`start`, the first step settled; :meth:`restart`, after an
  evaluation or a save), the next window starts at the next step's return (:meth:`returned`): one started at the
  settled point would leave its last step's work to the window after it and read faster than the steady rate.
  """

  def __init__(self, tokens_per_step: int, flops_per_token: float, peak_flops: float | None):
    self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
    self.t_mark, self.step_mark = time.perf_counter(), 0
    self.tokens_per_s: float | None = None
    self.mfu: float | None = None
    self._settled = False  # nothing in flight at the mark: the window starts at the next step's return

  def start(self, step: int) -> None:
    """``step`` done and settled: the first window starts at the next step's return."""
    self.t_mark, self.step_mark, self._settled = time.perf_counter(), step, True

  def returned(self, step: int, now: float) -> None:
    """Step ``step`` returned at ``now``: a window after a settled point starts here."""
    if self._settled:
      self.t_mark, self.step_mark, self._settled = now, step, False

  def mark(self, step: int, now: float) -> None:
    if step > self.step_mark:
      self.tokens_per_s = (step - self.step_mark) * self.tokens_per_step / (now - self.t_mark)
      self.mfu = self.flops_per_token * self.tokens_per_s / self.peak_flops if self.peak_flops else None
      self.t_mark, self.step_mark = now, step

  def restart(self) -> None:
    """After an evaluation or a save (the step's work drained): the next window starts at the next step's return."""
    self.t_mark, self._settled = time.perf_counter(), True
