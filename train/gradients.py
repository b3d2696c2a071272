"""The training script's gradient steps: one batch or several micro-batches, flushed or not, and their memory.

``make_grad_step`` returns ``grad_step(graphdef, params, batch, clip) ->
(loss, grads, scale, norm)``: the raw gradients, the factor ``scale`` the
optimizer multiplies them by (``grad_scale``), the global-norm clip's and,
for micro-batches, ``1/k``, and the global norm of the (mean) gradient
before the clip, which fires where ``norm >= clip``. Scaling is left to the optimizer because
rescaling gradients that XLA also flushes to the host made it keep every
activation of a 6.7B model at once (``docs/design.md``).

* one batch: one jitted program, whose ``out_shardings`` put gradients in
  host memory as ``jax_dos.gradient_shardings(tx, params, flush)`` says
  (the flush overlaps the backward pass);
* ``micro_batches = k``: ``k`` jitted calls, each adding its gradients to a
  running sum it takes donated (:func:`accumulated_grad_step`); no flush.

:func:`gradient_step_memory` compiles the step to tell the planner what it
needs on the accelerator (``jax_dos.StepMemory``); :func:`check_split_flush`
refuses a split flush that needs more than the plan assumed.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import jax_dos
from models import lm


def _constrained(tree: Any, layout: tuple | None) -> Any:
  """``tree`` laid out as ``layout`` (its leaves' shardings, flat), or as XLA likes where ``layout`` is ``None``."""
  if layout is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, jax.tree.unflatten(jax.tree.structure(tree), list(layout)))


class _Static:
  """A static argument whose hash is found once: jit hashes its static arguments at every call, and an NNX GraphDef
  hashes its whole graph (about 10 ms a call at 6.7B, on the training thread at every micro-batch)."""

  __slots__ = ("value", "_hash")

  def __init__(self, value: Any):
    self.value, self._hash = value, hash(value)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Static) and (other.value is self.value or other.value == self.value)


_STATICS: dict[int, _Static] = {}  # id(value) -> its wrapper (which holds it: the id stays its own); under the lock
_STATICS_LOCK = threading.Lock()


def _static(value: Any) -> _Static:
  """``value`` wrapped as :class:`_Static`, one wrapper an object (the last few objects kept)."""
  with _STATICS_LOCK:
    wrapped = _STATICS.get(id(value))
    if wrapped is None or wrapped.value is not value:
      if len(_STATICS) >= 8:
        _STATICS.pop(next(iter(_STATICS)))
      wrapped = _STATICS[id(value)] = _Static(value)
    return wrapped


def _unwrapped(graphdef: Any) -> Any:
  return graphdef.value if isinstance(graphdef, _Static) else graphdef


def _grad_step(graphdef, params, batch, clip: float):
  """``(loss, grads, scale, norm)``: the raw gradients, the global-norm clip's factor (1 when ``clip`` is 0), and
  the gradients' global norm."""
  loss, grads = jax.value_and_grad(lm.loss, argnums=1)(_unwrapped(graphdef), params, batch)
  norm = optax.global_norm(grads)
  scale = jax_dos.clip_scale(norm, clip) if clip > 0 else jnp.float32(1)
  return loss, grads, scale, norm


def micro_batch(x: jax.Array, index: jax.Array, micro_batches: int, shards: int) -> jax.Array:
  """Micro-batch ``index`` of ``micro_batches`` of ``x``'s rows, each of its ``shards`` row shards giving its own.

  ``x`` holds ``micro_batches x R`` rows laid out over ``shards`` devices,
  ``micro_batches x R / shards`` consecutive rows each. Micro-batch ``i``
  takes the ``i``-th ``R / shards`` rows of every shard, so each device
  slices the rows it already holds: no row crosses devices, and nothing
  leaves the program. One shard: rows ``[i R, (i + 1) R)``.
  """
  per_shard = x.shape[0] // (shards * micro_batches)
  parts = x.reshape(shards, micro_batches, per_shard, *x.shape[1:])
  return jax.lax.dynamic_index_in_dim(parts, index, axis=1, keepdims=False).reshape(shards * per_shard, *x.shape[1:])


def _accumulate_step(graphdef, params, grad_sum, batch, index, clip: float, micro_batches: int, shards: int,
                     layout: tuple | None, batch_layout: Any):  # fmt: skip
  """Micro-batch ``index`` of an accumulated step: ``(loss, grad_sum + grads, scale, norm)``.

  ``batch`` is the whole step's; the program takes its micro-batch itself
  (:func:`micro_batch`). After the last of ``micro_batches`` micro-batches,
  ``scale * grad_sum`` is the mean gradient times the clip's factor for that
  mean: ``scale = clip_scale(|grad_sum| / k, clip) / k``. The optimizer
  multiplies by it (``grad_scale``), so the sum is never divided on the
  accelerator. ``norm = |grad_sum| / k`` is the mean gradient's global norm,
  computed after the last micro-batch only (``lax.cond``: the others return
  0 and a scale of ``1/k``, which the caller drops). ``layout`` (the sum's
  shardings, flat) puts each micro-batch's gradients where the sum lies: on
  a mesh, a replicated parameter's are reduce-scattered into its partitioned
  state's layout (``jax_dos.state_shardings``).
  """
  part = tuple(micro_batch(x, index, micro_batches, shards) for x in batch)
  if batch_layout is not None:
    part = jax.lax.with_sharding_constraint(part, (batch_layout,) * len(part))
  loss, grads = jax.value_and_grad(lm.loss, argnums=1)(_unwrapped(graphdef), params, part)
  grad_sum = jax.tree.map(jnp.add, grad_sum, _constrained(grads, layout))
  mean = 1.0 / micro_batches
  kind = jax.eval_shape(optax.global_norm, grad_sum).dtype
  norm = jax.lax.cond(index == micro_batches - 1, lambda s: optax.global_norm(s) * mean,
                      lambda s: jnp.zeros((), kind), grad_sum)  # fmt: skip
  clip_factor = jax_dos.clip_scale(norm, clip) if clip > 0 else jnp.float32(1)
  return loss, grad_sum, clip_factor * jnp.float32(mean), norm


@functools.cache
def _programs(options: tuple[tuple[str, Any], ...]) -> tuple[Callable, Callable]:
  """``(grad step, accumulate step)`` jitted under XLA ``options`` (``jax_dos.remat_compiler_options``'s: on a mesh
  of GPUs, what keeps the rematerialisation), each compiled once a layout.

  The running sum is donated and updated in place: a micro-batch's program
  needs about what a one-batch step whose gradients stay on the accelerator
  needs (6.7B: 11.3 GiB of temporaries and the 12.4 GiB sum, against 7.0 +
  12.4; bench/probes/accum_probe.py). A scan over the micro-batches in one
  program needed about two gradients' worth more (CPU).
  """
  opts = dict(options) or None
  grad = jax.jit(_grad_step, static_argnums=(0, 3), compiler_options=opts)
  accumulate = jax.jit(_accumulate_step, static_argnums=(0, 5, 6, 7, 8, 9), donate_argnums=2, compiler_options=opts)
  return grad, accumulate


def _options(sharding: Any) -> tuple[tuple[str, Any], ...]:
  return tuple(sorted(jax_dos.remat_compiler_options(sharding).items()))


def _zeros_tree(tree: Any) -> Any:
  return jax.tree.map(jnp.zeros_like, tree)


@functools.cache
def _zeros_program(treedef: Any, layout: tuple | None) -> Callable:
  """A jitted ``zeros_like`` of trees of ``treedef``, laid out as ``layout`` (flat shardings) where given."""
  return jax.jit(_zeros_tree, out_shardings=None if layout is None else jax.tree.unflatten(treedef, list(layout)))


def _zeros_in(params: Any, layout: tuple | None) -> Any:
  """Zeros shaped as ``params``, laid out as ``layout`` (flat shardings) where given."""
  return _zeros_program(jax.tree.structure(params), layout)(params)


def sum_layout(params: Any, partitioned: bool) -> tuple | None:
  """The gradient sum's shardings (flat) on a mesh: the partitioned state's (``jax_dos.state_shardings``) with
  ``partitioned``, else the parameters' own; ``None`` off a mesh. Found once a layout of the parameters (every step
  asks)."""
  leaves = tuple((tuple(x.shape), x.dtype, getattr(x, "sharding", None)) for x in jax.tree.leaves(params))
  return _sum_layout(leaves, partitioned)


@functools.cache
def _sum_layout(leaves: tuple, partitioned: bool) -> tuple | None:
  if not leaves or not isinstance(leaves[0][2], NamedSharding):
    return None
  if not partitioned:
    return tuple(sharding.with_memory_kind("device") for _, _, sharding in leaves)
  return tuple(jax_dos.state_shardings([jax.ShapeDtypeStruct(*leaf[:2], sharding=leaf[2]) for leaf in leaves]))


def accumulated_grad_step(micro_batches: int, layout: tuple | None) -> Callable[..., tuple]:
  """``grad_step(graphdef, params, batch, clip) -> (loss, grad_sum, scale, norm)`` over ``micro_batches`` parts.

  The batch's rows are split into ``micro_batches`` equal parts, each the
  same share of every device's rows (:func:`micro_batch`; on one device,
  consecutive rows), run one after another (one jitted call each, taking the
  whole batch and its part's index, so only one part's activations are alive
  at a time and no part is copied out of the batch before). ``loss`` is the mean of their losses, which is the
  whole batch's mean loss; ``grad_sum`` the sum of their gradients, in the
  gradients' dtype, on the accelerator, laid out as ``layout`` (:func:`sum_layout` of the step's parameters: on a
  mesh, the partitioned state's layout); ``scale * grad_sum`` is the clipped
  mean gradient (:func:`_accumulate_step`), what ``optimizer_step`` takes; ``norm`` the mean gradient's norm.
  """

  def grad_step(graphdef, params, batch, clip: float):
    x = batch[0]  # (x, y), or packed rows' (x, y, segments, positions): each split alike
    if x.shape[0] % micro_batches:
      raise ValueError(f"a batch of {x.shape[0]} rows does not split into {micro_batches} equal micro-batches.")
    sharding = getattr(x, "sharding", None)
    batch_layout = sharding if isinstance(sharding, NamedSharding) else None
    shards = 1 if batch_layout is None else x.shape[0] // batch_layout.shard_shape(x.shape)[0]
    if x.shape[0] % (shards * micro_batches):
      raise ValueError(f"a batch of {x.shape[0]} rows over {shards} devices does not split into {micro_batches}"
                       " equal micro-batches of each device's rows.")  # fmt: skip
    accumulate = _programs(_options(sharding))[1]
    grad_sum, losses, static = _zeros_in(params, layout), [], _static(graphdef)
    for i in range(micro_batches):
      loss, grad_sum, scale, norm = accumulate(static, params, grad_sum, batch, np.int32(i), clip, micro_batches,
                                               shards, layout, batch_layout)  # fmt: skip
      losses.append(loss)
    return sum(losses) / micro_batches, grad_sum, scale, norm

  return grad_step


def make_grad_step(
  tx: optax.GradientTransformation | None, params: Any, flush: str = "host", micro_batches: int = 1
) -> Callable[..., tuple[jax.Array, Any, jax.Array, jax.Array]]:
  """``grad_step(graphdef, params, batch, clip) -> (loss, grads, clip_scale, norm)``, jitted.

  With ``tx`` (a ``jax_dos`` optimizer), gradients come out in host memory as
  ``jax_dos.gradient_shardings(tx, params, flush)`` says. With
  ``micro_batches > 1`` they are accumulated on the accelerator
  (:func:`accumulated_grad_step`) and flushed by none: the host subgroups'
  sums cross to the host in the optimizer's update. On a mesh a replicated
  parameter's gradients are reduce-scattered into its partitioned state's
  layout (with ``tx``; optax's state is replicated), and on GPUs the
  programs keep their rematerialisation (``jax_dos.remat_compiler_options``).
  """
  partitioned = tx is not None
  layout = sum_layout(params, partitioned)
  if micro_batches > 1:
    return accumulated_grad_step(micro_batches, layout)
  if tx is None or flush == "none":
    grads = None if layout is None else jax.tree.unflatten(jax.tree.structure(params), list(layout))
  else:
    grads = jax_dos.gradient_shardings(tx, params, flush)
  options = dict(_options(_first_sharding(params))) or None
  return _StaticGraph(
    jax.jit(_grad_step, static_argnums=(0, 3), out_shardings=(None, grads, None, None), compiler_options=options)
  )


class _StaticGraph:
  """A jitted ``f(graphdef, ...)`` called, and lowered, with its graphdef hashed once (:class:`_Static`)."""

  def __init__(self, jitted: Callable):
    self._jitted = jitted

  def __call__(self, graphdef, *args):
    return self._jitted(_static(graphdef), *args)

  def lower(self, graphdef, *args):
    return self._jitted.lower(_static(graphdef), *args)


def _first_sharding(tree: Any) -> Any:
  leaves = jax.tree.leaves(tree)
  return getattr(leaves[0], "sharding", None) if leaves else None


def _device_bytes(tree: Any, layout: tuple | None) -> int:
  """Bytes one device holds of ``tree`` laid out as ``layout`` (flat shardings; whole leaves where ``None``)."""
  leaves = jax.tree.leaves(tree)
  if layout is None:
    return sum(x.size * x.dtype.itemsize for x in leaves)
  return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize for x, s in zip(leaves, layout))


def probe_shardings(params: Any, flush: str, partitioned: bool = True) -> Any:
  """Gradient ``out_shardings`` of the program compiled to size the plan's budgets, before there is a plan.

  The flush's own layout where it does not depend on the plan (``"all"``:
  host memory, ``"none"``: the accelerator), else ``"all"``'s; on a mesh in
  :func:`sum_layout`'s layout (the partitioned state's with ``partitioned``).
  """
  layout = sum_layout(params, partitioned)
  if layout is None:
    layout = tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(params))
    if flush == "none" or None in layout:
      return None
  kind = "device" if flush == "none" else "pinned_host"
  leaves = jax.tree.leaves(params)
  shardings = [s.with_memory_kind(kind) if x.size else s for x, s in zip(leaves, layout)]
  return jax.tree.unflatten(jax.tree.structure(params), shardings)


def step_memory_bound(compiled: Any, params: Any, flush: str, partitioned: bool = True) -> jax_dos.StepMemory:
  """``jax_dos.StepMemory`` of a gradient step compiled with :func:`probe_shardings`, for the given flush.

  Exact for ``"all"`` and ``"none"`` (their own programs). With ``"host"``
  some gradients stay on the accelerator: all of them (each device's share)
  are counted on top of the flush-all program, a guess until the plan is
  made, which the split's own program can exceed (:func:`check_split_flush`
  refuses it then).
  """
  need = jax_dos.StepMemory.of(compiled)
  if flush in ("all", "none"):
    return need
  grads = _device_bytes(params, sum_layout(params, partitioned))
  return jax_dos.StepMemory(need.peak_bytes + grads, need.live_bytes + grads)


def gradient_step_memory(
  graphdef,
  params: Any,
  batch_shape: tuple[int, int],
  clip: float,
  flush: str,
  micro_batches: int = 1,
  batch_sharding: Any = None,
  partitioned: bool = True,
  parts: int = 2,
) -> jax_dos.StepMemory:
  """What the gradient step needs on the accelerator (``jax_dos.StepMemory``), from its compiled program.

  The program compiled is :func:`probe_shardings`'s (for ``"all"`` the one the
  training loop then runs, reusing the compilation); see
  :func:`step_memory_bound` for ``"host"``. With ``micro_batches > 1`` it is
  one micro-batch's program (``batch_shape`` is the whole batch's, which it takes whole), plus the
  running sum it updates in place, which stays alive through the update. ``batch_sharding`` lays the batch's rows
  out on a mesh (the figures are then each device's, the gradients in :func:`sum_layout`'s layout, and the
  programs compiled as the step compiles them: ``jax_dos.remat_compiler_options``). ``parts``: the batch's arrays,
  2 for ``(x, y)``, 4 for packed rows' ``(x, y, segments, positions)``.
  """
  options = _options(batch_sharding)
  if micro_batches > 1:
    batch = (jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding),) * parts
    shards = 1 if batch_sharding is None else batch_shape[0] // batch_sharding.shard_shape(batch_shape)[0]
    layout = sum_layout(params, partitioned)
    shardings = layout or tuple(getattr(p, "sharding", None) for p in jax.tree.leaves(params))
    grad_sum = jax.tree.unflatten(
      jax.tree.structure(params),
      [jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s) for p, s in zip(jax.tree.leaves(params), shardings)],
    )
    index = jax.ShapeDtypeStruct((), jnp.int32)
    accumulate = _programs(options)[1]
    compiled = accumulate.lower(_static(graphdef), params, grad_sum, batch, index, clip, micro_batches, shards, layout,
                                batch_sharding).compile()  # fmt: skip
    need = jax_dos.StepMemory.of(compiled)
    sums = _device_bytes(params, layout)
    return jax_dos.StepMemory(need.peak_bytes + sums, need.live_bytes + sums)
  batch = (jax.ShapeDtypeStruct(batch_shape, jnp.int32, sharding=batch_sharding),) * parts
  step = jax.jit(_grad_step, static_argnums=(0, 3), out_shardings=(None, probe_shardings(params, flush, partitioned),
                 None, None), compiler_options=dict(options) or None)  # fmt: skip
  return step_memory_bound(step.lower(_static(graphdef), params, batch, clip).compile(), params, flush, partitioned)


def check_split_flush(compiled: Any, assumed: jax_dos.StepMemory) -> None:
  """Refuses a split-flush gradient step (``--grad-flush host``) that needs more memory than the plan assumed.

  The plan's budgets bound the split by the flush-all program plus every
  gradient. XLA can need far more when a program's outputs go to two
  memories (47 GiB of temporaries at 6.7B, ``bench/probes/flush_probe.py``), and
  the run would fail out of memory some steps later.
  """
  need = jax_dos.StepMemory.of(compiled)
  if need.peak_bytes > assumed.peak_bytes:
    raise SystemExit(
      f"--grad-flush host: with this plan the gradient step needs {need.peak_bytes / 2**30:.1f} GiB of accelerator"
      f" memory, more than the {assumed.peak_bytes / 2**30:.1f} GiB its budgets left for it (XLA keeps much more"
      " when the gradients go to two memories). Use --grad-flush all (least memory) or --grad-flush none."
    )
