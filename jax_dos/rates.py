"""The update rates of the state's three paths: what the timeline, the routes and the collectives price a step with."""

from __future__ import annotations

import dataclasses


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
