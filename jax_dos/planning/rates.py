"""The update rates of the state's three paths: what the timeline, the routes and the collectives price a step with."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Rates:
  """Update rates of each path, parameters per second (``Calibration``'s fields of the same meaning)."""

  host: float
  stream: float
  device: float
  host_concurrent: float
  stream_concurrent: float
  stream_backward: float | None = None  # the stream path's cap while the backward pass runs (None: no cap)
  host_kernel: float = 0.0  # the host kernel alone, at the host's DRAM speed (0: not measured)

  @property
  def host_after_decision(self) -> float:
    """The host worker's rate after a fired clip's decision, beside the stream path: ``k h_c / h``.

    The gradients are in host memory by then and the worker only runs the
    kernel (``k``, :attr:`host_kernel`), slowed as the host path is beside
    the stream path (``h_c / h``); the plain engine's host rate ``h`` counts
    the copies too. Where the kernel was not measured, ``h_c``."""
    if self.host_kernel > 0 and self.host > 0:  # the slowdown first: exactly k where h_c = h
      return self.host_kernel * (self.host_concurrent / self.host)
    return self.host_concurrent

  @classmethod
  def of(cls, calibration: dict[str, Any], stream_backward: float | None = None) -> Rates:
    """The rates of a plan's calibration (``Plan.calibration``: ``Calibration.to_dict()``, already scaled to the
    optimizer's moments by ``Calibration.for_moments``)."""
    cal = calibration
    return cls(cal["host_rate"], cal["stream_rate"], cal["device_rate"], cal["host_rate_concurrent"],
               cal["stream_rate_concurrent"], stream_backward, cal.get("host_kernel_rate", 0.0))  # fmt: skip
