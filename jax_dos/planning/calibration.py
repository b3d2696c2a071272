"""Calibration: this machine's rates of each update path, measured with the real engine.

The cost model (``cost_model.py``) needs the rates of a :class:`~jax_dos.planning.cost_model.Calibration`.
They are measured here with the real optimizer (:class:`~jax_dos.optimizer.interleaved.InterleavedAdam`
with an explicit plan, stepped eagerly, timed with ``block_until_ready``) on
synthetic fp32 parameter trees. The rates are measured on subgroups shaped like
transformer layers (two tiny norm leaves and four matrices of 3 : 1 : 4 : 4,
:func:`layer_leaf_sizes`): the engine's cost per transferred array, and how it
contends with the other path, then match real models' trees (equal one-leaf
subgroups made the model 20-25% optimistic on a 4 B-parameter GPT tree, H200).

* the solo rates: every subgroup on one path (``host``, ``stream`` with two
  slots and with one, ``device``);
* the concurrent rates: fitted to the real engine running mixed plans at two
  host/stream splits (:func:`fit_concurrent_rates`). On the H100 machine the
  two paths together still beat either alone (BENCHMARKS.md). Two engines in
  two Python threads would measure their contention for the GIL rather than
  for DRAM;
* the fixed costs: per subgroup from many tiny one-leaf subgroups against one
  (what further leaves of a subgroup cost is in the rates), per resident
  jitted call, and per step.

A measurement on an accelerator leaves this process's pinned pool grown by
its engine's pinned state (about 16 GiB at the default size: XLA's pool never
gives regions back); :func:`measured_in_this_process` says so, and the
overlapped step then keeps its state in that pool rather than beside it
(``OverlappedStep(pinned_memory="auto")``).

Calibrations are cached as JSON in ``$XDG_CACHE_HOME/jax_dos/`` (default
``~/.cache/jax_dos/``), keyed by platform, device kind, hostname and jax
version. Override with a ``Calibration``, a dict, a JSON path, or the
environment variable ``JAX_DOS_CALIBRATION`` (a JSON path).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import math
import os
import socket
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos.core import adam_math, moment_formats
from jax_dos.core.adam_math import AdamHyper
from jax_dos.kernels import host_kernels
from jax_dos.memory.kinds import device_free_bytes
from jax_dos.optimizer.interleaved import InterleavedAdam
from jax_dos.planning import cost_model
from jax_dos.planning.cost_model import (
  ENV_OVERRIDE,
  Calibration,
  CalibrationSpec,
  as_calibration,
  calibration_key,
  predict,
)
from jax_dos.planning.plan import Plan, partition_leaves

log = logging.getLogger(__name__)
# 2 GiB per fp32 array. Smaller runs are dominated by the pipeline's fill and drain (the first subgroup's
# gradients, the last one's update): at 64 Mi the host rate came out 40% below a 1 B-parameter model's (H200).
GPU_DEFAULT_SIZE = 512 * 2**20
CALIBRATION_BYTES_PER_PARAM = 64  # accelerator and host memory a calibration run may need, per parameter (bound)
CPU_DEFAULT_SIZE = 2**16  # CPU backend: code paths only, no performance signal
_MIN_TIME = 1e-9  # clamp for differences of noisy timings


def cache_dir() -> Path:
  """``$XDG_CACHE_HOME/jax_dos`` (or ``~/.cache/jax_dos``)."""
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(base) / "jax_dos"


def current_key() -> str:
  """The cache key of this process's default backend."""
  d = jax.local_devices()[0]
  return calibration_key(d.platform, d.device_kind, socket.gethostname(), jax.__version__)


def accelerator_calibration_cached() -> bool:
  """Whether the cache holds an accelerator's calibration for this host and jax version, judged by file names alone:
  it starts no backend (a caller may want to measure in another process before this one starts its GPU client)."""
  tail = cost_model.calibration_key("x", "x", socket.gethostname(), jax.__version__).split("-", 2)[2]
  return any(not p.name.startswith("calibration-cpu-") for p in cache_dir().glob(f"calibration-*-{tail}.json"))


def cache_path(key: str | None = None) -> Path:
  return cache_dir() / f"calibration-{key or current_key()}.json"


def save(cal: Calibration, path: str | os.PathLike | None = None) -> Path:
  """Writes ``cal`` as JSON (atomically) to ``path`` or its cache file."""
  path = Path(path) if path is not None else cache_path(cal.key)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".tmp{os.getpid()}")
  tmp.write_text(json.dumps(cal.to_dict(), indent=1, sort_keys=True))
  os.replace(tmp, path)
  return path


def load_cached(key: str | None = None) -> Calibration | None:
  """The cached calibration for ``key`` (default: this machine), or ``None``."""
  key = key or current_key()
  path = cache_path(key)
  if not path.exists():
    return None
  try:
    cal = Calibration.from_dict(json.loads(path.read_text()))
  except (ValueError, TypeError, json.JSONDecodeError):
    return None  # a stale or damaged cache file is remeasured, not trusted
  return cal if cal.key == key else None


def get_calibration(spec: CalibrationSpec = None, **calibrate_kwargs) -> Calibration:
  """Resolves a calibration: ``spec`` if given, else ``$JAX_DOS_CALIBRATION``, else the cache, else measures."""
  if spec is not None:
    return as_calibration(spec)
  env = os.environ.get(ENV_OVERRIDE)
  if env:
    return as_calibration(env)
  return calibrate(**calibrate_kwargs)


# ----------------------------------------------------------------------------- measuring


def layer_leaf_sizes(size: int) -> list[int]:
  """Leaf sizes of one layer-shaped subgroup of ``size`` parameters (64 or more): a norm, attention's qkv and
  projection, a norm, the MLP's two matrices (3 : 1 : 4 : 4), summing to ``size``."""
  tiny = max(1, size // 2048)
  big = size - 2 * tiny
  qkv, proj, fc = 3 * big // 12, big // 12, 4 * big // 12
  return [tiny, qkv, proj, tiny, fc, big - qkv - proj - fc]


def _tree(n_subgroups: int, size: int, seed: int, layered: bool):
  """Params and grads: ``n_subgroups`` layer-shaped subgroups of ``size`` parameters (or one leaf each)."""
  sizes = layer_leaf_sizes(size) if layered else [size]
  names = [f"w{i:03d}_{j}" for i in range(n_subgroups) for j in range(len(sizes))]
  keys = jax.random.split(jax.random.key(seed), 2 * len(names))
  shapes = [(n,) for _ in range(n_subgroups) for n in sizes]
  params = {k: jax.random.normal(keys[i], s, jnp.float32) for i, (k, s) in enumerate(zip(names, shapes))}
  grads = {k: 1e-3 * jax.random.normal(keys[-1 - i], s, jnp.float32) for i, (k, s) in enumerate(zip(names, shapes))}
  return params, grads


class _Runner:
  """An :class:`InterleavedAdam` with an explicit plan over a synthetic tree, stepped eagerly."""

  def __init__(self, n_subgroups: int, size: int, plan, stream_slots: int = 2, seed: int = 0, layered: bool = False):
    self.params, self.grads = _tree(n_subgroups, size, seed, layered)
    self.size = n_subgroups * size
    subgroups, sizes = partition_leaves(self.params, size)
    assert len(subgroups) == n_subgroups, (len(subgroups), n_subgroups)
    placements = (plan,) * len(subgroups) if isinstance(plan, str) else tuple(plan)
    plan_obj = Plan(subgroups, placements, sizes, stream_slots=stream_slots, source="calibration")
    self.opt = InterleavedAdam(
      AdamHyper(1e-3, weight_decay=0.01), mask=None, subgroup_size=size, plan=plan_obj, planner=None, delay=0,
      delay_warmup=0, delay_predict=False, write_behind=False, partition_replicated=False,
    )  # fmt: skip
    self.state = self.opt.init(self.params)
    jax.block_until_ready(self.state)

  def step(self) -> float:
    t = time.perf_counter()
    updates, self.state = self.opt.update(self.grads, self.state, self.params)
    jax.block_until_ready((updates, self.state))
    return time.perf_counter() - t

  def time(self, reps: int, reduce=statistics.median) -> float:
    self.step()  # warm-up: compile, numba load
    return reduce([self.step() for _ in range(reps)])


KERNEL_RATE_PARAMS = 64 * 2**20  # parameters the host kernel alone is timed on: 1 GiB of buffers, far above any cache
# The host kernel alone is timed with each moment format: the compact ones are bound by their arithmetic, not by the
# bytes they save (cost_model's docstring), so Calibration.for_moments scales the host path by the measured ratio.
KERNEL_RATE_FIELDS = {
  "host_kernel_rate": "float32",
  "host_kernel_rate_bfloat16": "bfloat16",
  "host_kernel_rate_int8": "int8",
}


def host_kernel_rate(n: int, reps: int = 3, leave: int = 0, moments: str = "float32") -> float:
  """The host kernel's rate alone (params/s): AdamW in place on ``n`` float32 parameters with ``moments`` moments,
  bfloat16 gradients and a bfloat16 copy out, on buffers already in host memory, as the overlapped step's host worker
  runs it once the clip decision is known (a speculation steps into the spare state instead, 0.69-0.76x this rate
  with float32 moments: ``bench/results/host_kernel_into-h100``) (its thread count: all cores less ``leave`` where
  there are four times as many, ``host_kernels.set_num_threads``). Median of ``reps`` after a pass that touches the
  pages."""
  g, low = (np.zeros(n, jnp.bfloat16) for _ in range(2))
  p = np.zeros(n, np.float32)
  hyper = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.01)
  if moments == "float32":
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    scalars = np.asarray([-1e-3, 0.1, 0.001], np.float32)
  else:  # small moments, as a run's are; the compact kernels take the rounding's seed as a fifth scalar
    m, v = (moment_formats.host_encode(np.full(n, 1e-6, np.float32), moments, 1.0, salt) for salt in (0, 1))
    scalars = np.asarray(adam_math.step_scalars(AdamHyper(1e-3, moments=moments), jnp.asarray(10, jnp.int32)))

  def once() -> float:
    t = time.perf_counter()
    host_kernels.adam_many([(g, p, m, v, low)], [True], **hyper, scalars=scalars)
    return time.perf_counter() - t

  def timed() -> float:  # on a thread of its own: numba's thread count is set per launching thread
    host_kernels.set_num_threads(None, leave)
    once()
    return statistics.median(once() for _ in range(reps))

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return n / max(pool.submit(timed).result(), 1e-9)


def fit_concurrent_rates(solo: Calibration, size: int, n_subgroups: int, mixes) -> tuple[float, float]:
  """Host and stream rates while both run, fitted to measured mixed-plan step times.

  ``mixes`` holds ``(streamed subgroups, seconds)`` of plans that stream that
  many of the ``n_subgroups`` subgroups of ``size`` parameters and update the
  rest on the host. The slowdown of each path while the other runs is chosen
  so that the cost model (``cost_model.predict``) reproduces those times
  best (least squares of the relative error, on a grid): the model is then
  calibrated on exactly what it predicts.
  """
  best = (math.inf, 1.0, 1.0)
  grid = [1.0 + 0.025 * i for i in range(161)]  # slowdowns 1x .. 5x
  for slow_h in grid:
    for slow_s in grid:
      cal = dataclasses.replace(
        solo, host_rate_concurrent=solo.host_rate / slow_h, stream_rate_concurrent=solo.stream_rate / slow_s
      )
      err = 0.0
      for k_s, t in mixes:
        k_h = n_subgroups - k_s
        pred = predict(cal, n_host=k_h * size, n_stream=k_s * size, k_host=k_h, k_stream=k_s)["total"]
        err += ((pred - t) / t) ** 2
      if err < best[0]:
        best = (err, slow_h, slow_s)
  return solo.host_rate / best[1], solo.stream_rate / best[2]


def measure(
  *, size: int | None = None, n_subgroups: int = 8, reps: int = 3, tiny_subgroups: int | None = None
) -> Calibration:
  """Measures a :class:`Calibration` now (no cache).

  ``size`` parameters per path, in ``n_subgroups`` equal layer-shaped
  subgroups; fixed costs from ``tiny_subgroups`` one-leaf subgroups of 8
  parameters (default 32; 8 on the CPU backend).
  """
  dev = jax.local_devices()[0]
  free = device_free_bytes()
  on_cpu = dev.platform == "cpu"
  if size is None:
    size = CPU_DEFAULT_SIZE if on_cpu else GPU_DEFAULT_SIZE
    if free is not None:  # a smaller accelerator gets a smaller (less representative) calibration
      size = max(2**20, min(size, free // CALIBRATION_BYTES_PER_PARAM))
  tiny_subgroups = tiny_subgroups or (8 if on_cpu else 32)
  leaf = max(64, size // n_subgroups)  # parameters per subgroup
  n = leaf * n_subgroups
  # Fixed costs first (fastest of the repetitions: noise only adds): many tiny subgroups against one.
  tiny = 8

  def fixed(path: str) -> tuple[float, float]:
    t_one = _Runner(1, tiny, path).time(reps, min)
    t_many = _Runner(tiny_subgroups, tiny, path).time(reps, min)
    return t_one, max(_MIN_TIME, (t_many - t_one) / (tiny_subgroups - 1))

  t1_host, ovh_host = fixed("host")
  t1_stream, ovh_stream = fixed("stream")
  t1_dev = _Runner(1, tiny, "device").time(reps, min)
  step = max(_MIN_TIME, min(t1_host - ovh_host, t1_stream - ovh_stream, t1_dev / 2))
  dev_call = max(_MIN_TIME, t1_dev - step)

  # Rates net of the fixed costs the model adds back (at most 3/4 of a time is taken as fixed).
  def rate(params: int, t: float, fixed_s: float) -> float:
    return params / max(t - fixed_s, 0.25 * t)

  timed = lambda path, slots=2: _Runner(n_subgroups, leaf, path, slots, layered=True).time(reps)  # noqa: E731
  host_rate = rate(n, timed("host"), step + n_subgroups * ovh_host)
  device_rate = rate(n, timed("device"), step + dev_call)
  stream_rate = rate(n, timed("stream"), step + n_subgroups * ovh_stream)
  stream_rate_single = rate(n, timed("stream", 1), step + n_subgroups * ovh_stream)

  solo = Calibration(
    host_rate=host_rate,
    stream_rate=stream_rate,
    device_rate=device_rate,
    host_rate_concurrent=host_rate,
    stream_rate_concurrent=stream_rate,
    stream_rate_single=stream_rate_single,
    subgroup_overhead_host=ovh_host,
    subgroup_overhead_stream=ovh_stream,
    device_call_overhead=dev_call,
    step_overhead=step,
  )
  # Concurrent: the real engine on mixed plans (host worker thread + streaming at once), at two splits.
  mixes = []
  for k_stream in sorted({max(1, n_subgroups * 3 // 8), max(1, n_subgroups - n_subgroups * 3 // 8)}):
    k_stream = min(k_stream, n_subgroups - 1) if n_subgroups > 1 else 1
    placements = ["stream"] * k_stream + ["host"] * (n_subgroups - k_stream)
    mixes.append((k_stream, timed(placements)))
  host_c, stream_c = fit_concurrent_rates(solo, leaf, n_subgroups, mixes)
  return dataclasses.replace(
    solo,
    host_rate_concurrent=host_c,
    stream_rate_concurrent=stream_c,
    **{
      field: host_kernel_rate(min(n, KERNEL_RATE_PARAMS), reps, host_kernels.TRAINING_CORES, moments)
      for field, moments in KERNEL_RATE_FIELDS.items()
    },
    device_free_bytes=free,
    platform=dev.platform,
    device_kind=dev.device_kind,
    hostname=socket.gethostname(),
    jax_version=jax.__version__,
    size=n,
    measured_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  )


_measured_here = False  # (set once, by the thread that measured) whether this process measured on an accelerator


def measured_in_this_process() -> bool:
  """Whether this process measured a calibration on an accelerator: XLA's pinned pool then holds its engine's
  pinned regions (about 16 GiB at the default size) for the rest of the process."""
  return _measured_here


def calibrate(*, size: int | None = None, force: bool = False, cache: bool = True, reps: int = 3) -> Calibration:
  """This machine's :class:`Calibration`: from the cache, or measured (and cached).

  Args:
    size: parameters per measured path (default: 512 Mi on an accelerator,
      2 GiB per fp32 array, less if free accelerator memory is short; 64 Ki
      on the CPU backend).
    force: measure even if a cached calibration exists.
    cache: read and write the cache (``cache_dir()``).
    reps: timed repetitions per measurement (median, after one warm-up).
  """
  if cache and not force:
    cal = load_cached()
    if cal is not None:
      return cal
  # Information, not a warning: an application shows jax_dos's INFO records to say why init pauses (train.gpt does).
  took = "a few seconds" if jax.default_backend() == "cpu" else "20-30 s"
  log.info("jax_dos: measuring this machine for the performance model (plan='auto'); %s, then cached.", took)
  global _measured_here
  cal = measure(size=size, reps=reps)
  if jax.default_backend() != "cpu":
    _measured_here = True
    log.info(
      "jax_dos: the calibration's pinned state stays in XLA's pinned pool for the rest of this process, so an"
      " overlapped step made here keeps its state in that pool (more host memory, a slower exit); later processes"
      " read the cached calibration and keep it in pinned memory of their own."
    )
  if cache:
    try:
      log.debug("jax_dos: calibration cached in %s", save(cal))
    except OSError:
      pass  # a read-only home is no reason to fail; the calibration is still returned
  return cal
