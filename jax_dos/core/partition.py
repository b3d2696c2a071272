"""Partitioned state for replicated parameters (ZeRO-1/2 style): the layout of a leaf's Adam state on a mesh.

A parameter replicated over mesh axes (data parallelism) would keep a whole
copy of its float32 master, mu and nu in every device's memory. Partitioned,
its state is split over those axes along one dimension: each device holds and
updates ``1/N`` of it (``N`` the product of those axes' sizes), and the new
parameters are gathered back to their replicated layout (by XLA: an
all-gather, across processes too). A parameter already sharded over every
axis (FSDP) keeps its own layout: its state is per shard already.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from jax_dos.memory import kinds as memory


def _axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes one entry of a ``PartitionSpec`` names (``None``, one axis, or several)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def state_sharding(x: Any) -> Sharding | None:
  """The sharding of ``x``'s state when partitioned, or ``None`` where it keeps ``x``'s own.

  ``x``'s ``NamedSharding`` with the mesh axes it is replicated over (those of
  size > 1) added, in mesh order, to the first dimension they divide (with
  the axes that dimension is sharded over already). ``None`` for traced or
  unsharded values, scalars, and leaves no dimension of which they divide:
  those keep a whole copy per device.
  """
  sharding = getattr(x, "sharding", None)
  shape = tuple(getattr(x, "shape", ()))
  if not isinstance(sharding, NamedSharding) or memory.is_traced(x) or not math.prod(shape):
    return None
  spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
  used = {a for entry in spec for a in _axes(entry)}
  free = [a for a in sharding.mesh.axis_names if a not in used and sharding.mesh.shape[a] > 1]
  if not free:
    return None
  for d, entry in enumerate(spec):
    axes = _axes(entry)
    if shape[d] % math.prod(sharding.mesh.shape[a] for a in (*axes, *free)) == 0:
      spec[d] = (*axes, *free)
      return NamedSharding(sharding.mesh, P(*spec), memory_kind=sharding.memory_kind)
  return None


def state_layout(params: Any) -> Any:
  """``params`` as their partitioned state is laid out: ``ShapeDtypeStruct`` where it differs, else the leaf."""

  def layout(x):
    s = state_sharding(x)
    return x if s is None else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

  return jax.tree.map(layout, params)


def state_sharding_in(x: Any, memory_kind: str) -> Sharding:
  """The sharding of ``x``'s state (:func:`state_sharding`; ``x``'s own where it is not partitioned), in
  ``memory_kind``."""
  s = state_sharding(x)
  return memory.with_kind(x, memory_kind) if s is None else s.with_memory_kind(memory_kind)


def state_shardings(params: Any, memory_kind: str = "device") -> Any:
  """A tree like ``params`` of the sharding each leaf's partitioned state takes (:func:`state_sharding_in`).

  It is also where a replicated parameter's gradient belongs: a gradient step
  that puts its gradients there reduce-scatters them (each device gets the
  sum of its share) instead of all-reducing them, half the bytes a device
  sends and keeps. ``params``: arrays or ``ShapeDtypeStruct`` s with shardings.
  """
  return jax.tree.map(lambda x: state_sharding_in(x, memory_kind), params)


def same_layout(x: jax.Array, like: jax.Array) -> bool:
  """Whether ``x`` is laid out over devices as ``like`` is (memory kinds aside)."""
  return _same_layout(x.sharding, like.sharding, x.ndim)


@functools.lru_cache(maxsize=4096)
def _same_layout(sharding: Sharding, like: Sharding, ndim: int) -> bool:
  """:func:`same_layout` of two shardings, found once a pair (a step asks it of every leaf, twice)."""
  return sharding.is_equivalent_to(like.with_memory_kind(sharding.memory_kind), ndim)


def relaid(xs: list[jax.Array], likes: list[jax.Array]) -> list[jax.Array]:
  """``xs`` laid out as ``likes`` (each in its own memory kind); the others as they are.

  Into a partitioned layout this is a slice of what each device holds; out
  of one, an all-gather (NCCL between GPUs, across processes too). Arrays in
  accelerator memory move together in one jitted copy (:func:`_relayout`),
  those in host memory by ``jax.device_put``.
  """
  out = list(xs)
  device, host = [], []  # (index, target) of the arrays that move, by the memory they are in
  for j, (x, like) in enumerate(zip(xs, likes)):
    if not isinstance(x, jax.Array) or getattr(like, "sharding", None) is None or like is x or same_layout(x, like):
      continue
    target = like.sharding.with_memory_kind(x.sharding.memory_kind)
    (device if memory.memory_kind(x) == "device" else host).append((j, target))
  if device:
    moved = _relayout(tuple(t for _, t in device))(*(xs[j] for j, _ in device))
    for (j, _), y in zip(device, moved):
      out[j] = y
  if host:
    for (j, _), y in zip(host, jax.device_put([xs[j] for j, _ in host], [t for _, t in host])):
      out[j] = y
  return out


@functools.cache
def _relayout(targets: tuple[Sharding, ...]) -> Callable[..., tuple[jax.Array, ...]]:
  """One jitted copy of accelerator arrays into ``targets``' layouts (compiled once a list of shapes).

  Not ``jax.device_put``: in one process of several devices it copies a fully
  addressable array into another layout through the host
  (``shard_sharded_device_array_slow_path`` in jax 0.11.2: a 6.7B GPT's plain
  step on 2 H200s took 26 s a step). XLA slices, or all-gathers, on the
  devices, every array of a call in one program (one dispatch, its
  collectives combined).
  """
  return jax.jit(_identity, out_shardings=targets, compiler_options=_combined_collectives(targets))


# XLA's bound on the bytes of collectives it combines into one (on GPUs: one NCCL group a combined collective).
COMBINE_BYTES = 1 << 34


def _combined_collectives(targets: tuple[Sharding, ...]) -> dict[str, Any] | None:
  """On GPUs, every all-gather of a relayout combined into one: each NCCL collective XLA launches costs the
  launching thread about 0.3 ms, and the 6.7B GPT's 129 all-gathers of its new weights, one a leaf, kept two H100s
  idle 32 ms a step between the update and the gather (a 1 GB leaf exceeds XLA's default bound of 30 MB); ``None``
  elsewhere."""
  devices = targets[0].device_set if targets else ()
  if len(devices) < 2 or next(iter(devices)).platform != "gpu":
    return None
  return {"xla_gpu_all_gather_combine_threshold_bytes": COMBINE_BYTES}


def _identity(*xs: jax.Array) -> tuple[jax.Array, ...]:
  return xs


class ParamStateLayouts:
  """Each leaf's parameter layout and its state's, and the moves between them (``OverlappedStep``'s training thread).

  The state is partitioned (:func:`state_sharding`) where ``partition`` and the parameter is replicated over mesh
  axes, else in the parameter's own layout. :meth:`to_state` slices what each device holds (no collective);
  :meth:`to_params` gathers it back (an all-gather, across processes too).
  """

  def __init__(self, params: list[jax.Array], partition: bool):
    self.params = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in params]
    layout = state_layout(list(params)) if partition else params
    self.state = [s if isinstance(s, jax.ShapeDtypeStruct) else p for s, p in zip(layout, self.params)]
    self.partitioned = any(a is not b for a, b in zip(self.state, self.params))

  def to_state(self, xs: list[jax.Array], leaves: Any) -> list[jax.Array]:
    """``xs``, the arrays of ``leaves``, in their state's layout."""
    return relaid(list(xs), [self.state[i] for i in leaves]) if self.partitioned else list(xs)

  def to_params(self, xs: list[jax.Array], leaves: Any) -> list[jax.Array]:
    """``xs``, the arrays of ``leaves``, in their parameters' layout."""
    return relaid(list(xs), [self.params[i] for i in leaves]) if self.partitioned else list(xs)
