"""The run's pinned host memory, bounded before jax starts: XLA's pinned pool capped at what the plan can need.

XLA's GPU client reads its pinned pool's cap once, when it starts, and the
step's plan is made only later (it needs the device and the model). So
:func:`cap_host_memory`, called before jax starts, takes the most the flags
allow: the preset's parameter count (its model's ``param_count``, no jax) and
``jax_dos.host_need_bound``, and caps the pool there
(``jax_dos.cap_pinned_pool``); a run whose state must be offloaded
(``--offload host`` or ``stream``) and cannot fit the host's RAM ends there,
saying what to change, before anything moves.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import jax_dos
from train import overlapped
from train.flags import Flags, model_config, model_module, model_name

ADVICE = (
  "Use a smaller --preset, keep more state on the accelerator (--offload auto or device), train with --overlap off"
  " (the plain step needs no spare state), or use a machine with more RAM."
)


def pinned_need(args: Flags, host_memory_bytes: int | None = None) -> tuple[int, int]:
  """``(certain, most)`` pinned host bytes the run can need, from the flags alone: ``most`` in any plan
  (``jax_dos.host_need_bound``), ``certain`` in every plan (the state itself where ``--offload`` puts it all on the
  host)."""
  if args.offload == "none":
    return 0, 0
  n = model_module(args).param_count(model_config(args))  # a model the flags' own checks have taken
  param_bytes = 4 if args.param_dtype == "float32" else 2
  may_overlap = args.overlap != "off" and overlapped.refusal(args) is None
  most = jax_dos.host_need_bound(
    n, param_bytes, overlapped=may_overlap, moment_copies=args.delay_predict == "gradient",
    host_memory_bytes=host_memory_bytes, moments=args.moments,
  )  # fmt: skip
  certain = math.ceil(jax_dos.state_bytes_per_param(args.moments) * n) if args.offload in ("host", "stream") else 0
  return certain, most


def cap_host_memory(args: Flags, host_memory_bytes: int | None = None) -> int | None:
  """Caps XLA's pinned pool at the run's most (:func:`pinned_need`) before jax starts; returns the cap in bytes
  (``None``: unchanged, a value the user set, or jax already started). A run that cannot fit ``host_memory_bytes``
  (default the machine's RAM) is a ``SystemExit`` naming the numbers and what to change.

  First the pool may take 90 % of the host's RAM (``jax_dos.configure_process``'s cap, XLA's own is 64 GiB), which a
  run that offloads lowers to its need."""
  jax_dos.configure_process()  # before jax starts; with --devices, parallel.select_devices calls it again
  certain, most = pinned_need(args, host_memory_bytes)
  if not most:
    return None
  what = f"{model_name(args)} with --offload {args.offload}"
  try:
    return jax_dos.cap_pinned_pool(
      most, certain_bytes=certain, host_memory_bytes=host_memory_bytes, what=what, advice=ADVICE
    )
  except MemoryError as e:
    raise SystemExit(f"error: {e}") from None


def release_freed_heap() -> bool:
  """Hands the C heap's freed pages back to the system (glibc's ``malloc_trim(0)``); ``False`` where the C library
  has no such call.

  Compiling a large model's programs leaves hundreds of MiB to GiBs of freed
  memory in glibc's per-thread arenas, which it keeps: the process's resident
  set would carry them through training beside the pinned state. Called once
  the first step has compiled and allocated everything.
  """
  name = ctypes.util.find_library("c")
  try:
    trim = ctypes.CDLL(name).malloc_trim if name else None
  except (OSError, AttributeError):
    trim = None
  if trim is None:
    return False
  trim(0)
  return True
