"""The cost model: the rates of the update paths, and the predicted time of one step.

A :class:`Calibration` holds this machine's rates, in parameters per second,
and fixed costs, in seconds (``calibration.py`` measures them with the real
engine):

* ``host_rate`` (``h``): every subgroup on the host kernel, including the
  gradient device-to-host copy and the update host-to-device copy that path needs;
* ``stream_rate`` (``s``): every subgroup streamed through the accelerator with
  two subgroups in flight (both PCIe directions busy); ``stream_rate_single``
  with one in flight (directions serialised);
* ``device_rate`` (``d``): state resident in accelerator memory;
* ``host_rate_concurrent`` / ``stream_rate_concurrent`` (``h_c, s_c``): each
  path's rate while the other one runs. Host kernel and DMA share host DRAM,
  so each path slows down while the other runs;
* ``host_kernel_rate`` (``k``): the host kernel alone, on buffers already in
  host memory (no copies), as the overlapped step's host worker runs it after
  a fired clip's decision (0: not measured); ``host_kernel_rate_bfloat16``
  and ``host_kernel_rate_int8`` the same kernel on compact moments;
* ``subgroup_overhead_host`` / ``_stream`` (``o_host, o_stream``) per
  subgroup, ``device_call_overhead`` (``o_call``) per jitted call that
  updates resident subgroups (one per 256 Mi parameters), and
  ``step_overhead`` (``o_step``) paid by every step (step scalars, count
  increment).

``device_free_bytes`` is the accelerator memory free when calibrating
(``None`` on the CPU backend); the budgets prefer the memory free at plan time.

Model of one eager update step (``engine.py``)::

    W_D = c o_call + N_D / d                c = ceil(N_D / 256 Mi) jitted calls for resident subgroups
    W_H = N_H / h + K_H o_host               host kernel, incl. gradient D2H and update H2D
    W_S = N_S / s + K_S o_stream             streamed through the accelerator

``W`` is each path's work in *solo seconds*. The host path starts at 0; the
stream path starts at ``W_D`` (its jitted updates queue behind the resident
update on the accelerator, a slightly pessimistic assumption). While both run,
the host path advances at ``h_c / h`` of its solo speed and the stream path at
``s_c / s`` of its own: on a one-socket machine where DRAM binds, ``h_c + s_c``
is about ``max(h, s)``, not ``h + s``. When one path finishes the other
continues at its solo speed. The predicted time is ``o_step + max(W_D,
finish_H, finish_S)``. ``K`` counts subgroups (the engine makes one batched
transfer and one jitted call per subgroup; what its further leaves cost is in
the rates, which the calibration measures on layer-shaped subgroups of six
leaves); with one stream slot in flight (no overlap of the two PCIe
directions) ``s`` is the calibration's ``stream_rate_single``.

The engine runs each path's subgroups in plan order and all gradients exist
before the step begins, so the prediction depends only on which subgroups go
where, not on their order. Accelerator memory per parameter: ``STATE_BYTES``
resident, ``STAGING_BYTES`` for a streamed subgroup in flight (``plan.py``).

Compact moments (``interleaved_adam(moments=...)``): the calibration measures
the engine with float32 moments, and :meth:`Calibration.for_moments` scales
each rate by how much less its path does a parameter. The host kernel reads
``g, p, m, v`` and writes ``p, m, v``: ``4 + 8 + 2 * 2 b`` bytes with ``b``
bytes a moment (``moment_formats.bytes_per_moment``: 4, 2, about 1), so 28,
20 and 16 B, which would make it 1.4x (bfloat16) and 1.74x (int8) faster if
the DRAM bound it. It does not: the compact kernels are bound by their
arithmetic a core (on the H100 machines' 16 cores bfloat16 ran 1.07-1.14x
float32's rate and int8 0.68-0.80x, ``bench/results/host_kernel-h100``), so
the host path's rates (``h``, ``h_c``, ``k``) take the kernel's measured
ratio ``k_b / k`` where the calibration timed both, else the bytes' (an upper
bound); the resident update moves the bytes' ratio in accelerator memory;
a streamed parameter's state crosses PCIe both ways, ``2 (4 + 2 b)`` bytes
beside its 2 B gradient.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Union

from jax_dos.core import moment_formats
from jax_dos.planning.plan import RESIDENT_CALL_ELEMENTS

ENV_OVERRIDE = "JAX_DOS_CALIBRATION"  # a JSON path that replaces the measured calibration
DEFAULT_MAX_STREAM_SLOTS = 2

_RATE_FIELDS = (
  "host_rate",
  "stream_rate",
  "stream_rate_single",
  "device_rate",
  "host_rate_concurrent",
  "stream_rate_concurrent",
  "host_kernel_rate",
)
_COMPACT_KERNEL_FIELDS = ("host_kernel_rate_bfloat16", "host_kernel_rate_int8")  # not scaled by for_moments
_MAY_BE_UNMEASURED = ("stream_rate_single", "host_kernel_rate", *_COMPACT_KERNEL_FIELDS)  # 0: not measured
_TIME_FIELDS = ("subgroup_overhead_host", "subgroup_overhead_stream", "device_call_overhead", "step_overhead")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Measured rates (params/s) and fixed costs (s) of the update paths; see the module docstring."""

  host_rate: float
  stream_rate: float
  device_rate: float
  host_rate_concurrent: float
  stream_rate_concurrent: float
  stream_rate_single: float = 0.0  # 0: unknown, the model takes stream_rate / 2
  host_kernel_rate: float = 0.0  # 0: not measured (a calibration cached before it was)
  host_kernel_rate_bfloat16: float = 0.0  # the kernel alone on bfloat16 moments (0: not measured)
  host_kernel_rate_int8: float = 0.0  # on int8 moments (0: not measured)
  subgroup_overhead_host: float = 0.0
  subgroup_overhead_stream: float = 0.0
  device_call_overhead: float = 0.0
  step_overhead: float = 0.0
  device_free_bytes: int | None = None
  platform: str = ""
  device_kind: str = ""
  hostname: str = ""
  jax_version: str = ""
  size: int = 0  # parameters per measurement
  measured_at: str = ""

  def __post_init__(self):
    for name in _RATE_FIELDS + _COMPACT_KERNEL_FIELDS:
      v = getattr(self, name)
      ok = math.isfinite(v) and (v > 0 or (name in _MAY_BE_UNMEASURED and v == 0))
      if not ok:
        raise ValueError(f"Calibration.{name} must be a positive finite rate in params/s, got {v!r}.")
    for name in _TIME_FIELDS:
      v = getattr(self, name)
      if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"Calibration.{name} must be a finite number of seconds >= 0, got {v!r}.")

  def kernel_ratio(self, moments: str) -> float:
    """How many times faster the host kernel steps a parameter with ``moments`` than with float32 moments: measured
    (``host_kernel_rate_<moments> / host_kernel_rate``) where the calibration timed both, else the ratio of the DRAM
    bytes it moves (``kernel_bytes``), an upper bound (the module docstring)."""
    if moments == "float32":
      return 1.0
    measured = getattr(self, f"host_kernel_rate_{moments}", 0.0)
    if measured and self.host_kernel_rate:
      return measured / self.host_kernel_rate
    return kernel_bytes("float32") / kernel_bytes(moments)

  def for_moments(self, moments: str) -> Calibration:
    """These rates with moments stored as ``moments`` (the module docstring's scaling): the host path's by
    :meth:`kernel_ratio`, the resident update's by the bytes the kernel moves, the stream path's by its PCIe bytes."""
    if moments == "float32":
      return self
    factor = {"stream": stream_bytes("float32") / stream_bytes(moments), "host": self.kernel_ratio(moments),
              "device": kernel_bytes("float32") / kernel_bytes(moments)}  # fmt: skip
    scaled = {f: getattr(self, f) * factor[f.split("_")[0]] for f in _RATE_FIELDS}
    return dataclasses.replace(self, **scaled)

  @property
  def key(self) -> str:
    """Cache key: platform, device kind, hostname, jax version."""
    return calibration_key(self.platform, self.device_kind, self.hostname, self.jax_version)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Calibration:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"unknown Calibration fields {unknown}; known fields: {sorted(names)}.")
    missing = [n for n in ("host_rate", "stream_rate", "device_rate") if n not in d]
    if missing:
      raise ValueError(f"a Calibration needs at least {missing} (params/s).")
    d = dict(d)
    # Unknown concurrency defaults to no slowdown (the paths add up); say so by giving them.
    d.setdefault("host_rate_concurrent", d["host_rate"])
    d.setdefault("stream_rate_concurrent", d["stream_rate"])
    return cls(**d)

  def summary(self) -> str:
    g = lambda r: f"{r / 1e9:.3g} G/s"  # noqa: E731
    return (
      f"host {g(self.host_rate)}, stream {g(self.stream_rate)}, device {g(self.device_rate)},"
      f" concurrent host {g(self.host_rate_concurrent)} + stream {g(self.stream_rate_concurrent)}"
      + (f", host kernel alone {g(self.host_kernel_rate)}" if self.host_kernel_rate else "")
      + "".join(
        f" ({g(getattr(self, f))} with {f.rsplit('_', 1)[1]} moments)"
        for f in _COMPACT_KERNEL_FIELDS
        if getattr(self, f)
      )
    )


CalibrationSpec = Union[Calibration, dict, str, os.PathLike, None]


def kernel_bytes(moments: str, grad_bytes: int = 4) -> float:
  """DRAM bytes the host kernel moves a parameter: reads ``g, p, m, v``, writes ``p, m, v`` (28 for float32)."""
  return grad_bytes + 8 + 4 * moment_formats.bytes_per_moment(moments)


def stream_bytes(moments: str, grad_bytes: int = 2) -> float:
  """PCIe bytes of a streamed parameter: its state both ways and its gradient (26 for float32 moments)."""
  return 2 * moment_formats.state_bytes_per_param(moments) + grad_bytes


def _slug(s: str) -> str:
  return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "unknown"


CACHE_FORMAT = 4  # bump when what is measured changes, so stale caches are measured again


def calibration_key(platform: str, device_kind: str, hostname: str, jax_version: str) -> str:
  """The cache key of a calibration: platform, device kind, hostname, jax version and the cache format."""
  return "-".join(_slug(x) for x in (platform, device_kind, hostname, "jax" + jax_version, f"v{CACHE_FORMAT}"))


def as_calibration(spec: Calibration | dict | str | os.PathLike) -> Calibration:
  """A :class:`Calibration` from itself, a dict of its fields, or a JSON file path."""
  if isinstance(spec, Calibration):
    return spec
  if isinstance(spec, dict):
    return Calibration.from_dict(spec)
  if isinstance(spec, (str, os.PathLike)):
    path = Path(spec)
    if not path.exists():
      raise FileNotFoundError(f"calibration file {str(path)!r} does not exist (from a path or ${ENV_OVERRIDE}).")
    return Calibration.from_dict(json.loads(path.read_text()))
  raise TypeError(f"expected a Calibration, a dict or a JSON path, got {type(spec).__name__}.")


# ----------------------------------------------------------------------------- the model


def _two_paths(w1: float, start1: float, slow1: float, w2: float, start2: float, slow2: float) -> tuple[float, float]:
  """Finish times of two paths with ``w`` solo-seconds of work each, starting at ``start``.

  Alone a path advances at speed 1; while both run, at ``1 / slow``. A path
  with no work finishes at 0.
  """
  rem, start, slow = [w1, w2], [start1, start2], [slow1, slow2]
  fin = [0.0 if w <= 0 else math.inf for w in rem]
  t = min((start[i] for i in (0, 1) if fin[i] == math.inf), default=0.0)
  while math.inf in fin:
    active = [i for i in (0, 1) if fin[i] == math.inf and start[i] <= t]
    speed = {i: (1.0 / slow[i] if len(active) == 2 else 1.0) for i in active}
    ends = {i: t + rem[i] / speed[i] for i in active}
    pending = [start[i] for i in (0, 1) if fin[i] == math.inf and start[i] > t]
    t_next = min([*ends.values(), *pending])
    for i in active:
      if ends[i] <= t_next:
        fin[i], rem[i] = t_next, 0.0
      else:
        rem[i] -= (t_next - t) * speed[i]
    t = t_next
  return fin[0], fin[1]


def _stream_rates(cal: Calibration, stream_slots: int) -> tuple[float, float]:
  if stream_slots >= 2:
    return cal.stream_rate, cal.stream_rate_concurrent
  single = cal.stream_rate_single or cal.stream_rate / 2
  return single, cal.stream_rate_concurrent * single / cal.stream_rate


def predict(
  cal: Calibration,
  *,
  n_device: float = 0,
  n_host: float = 0,
  n_stream: float = 0,
  k_host: float = 0,
  k_stream: float = 0,
  stream_slots: int = DEFAULT_MAX_STREAM_SLOTS,
) -> dict[str, float]:
  """Predicted seconds of one step: when each path finishes, and ``"total"`` (see module docstring).

  ``n_*`` are parameters per path, ``k_*`` subgroups per path (fixed costs).
  """
  s, s_c = _stream_rates(cal, stream_slots)
  calls = math.ceil(n_device / RESIDENT_CALL_ELEMENTS)  # the engine's jitted calls for resident subgroups
  w_d = calls * cal.device_call_overhead + n_device / cal.device_rate if n_device > 0 else 0.0
  w_h = n_host / cal.host_rate + k_host * cal.subgroup_overhead_host if (n_host > 0 or k_host > 0) else 0.0
  w_s = n_stream / s + k_stream * cal.subgroup_overhead_stream if (n_stream > 0 or k_stream > 0) else 0.0
  slow_h = max(1.0, cal.host_rate / cal.host_rate_concurrent)
  slow_s = max(1.0, s / s_c)
  fin_h, fin_s = _two_paths(w_h, 0.0, slow_h, w_s, w_d, slow_s)
  total = cal.step_overhead + max(w_d, fin_h, fin_s)
  return {"device": w_d, "host": fin_h, "stream": fin_s, "total": total}
