"""A model as a sequence of stages, each with its own jitted forward and backward program.

A staged model computes its loss as a chain of stage functions::

    x_1 = f_0(P_0, None, batch)            (the first stage reads the batch: embeddings)
    x_{i+1} = f_i(P_i, x_i, batch)         (blocks)
    loss = f_{n-1}(P_{n-1}, x_{n-1}, batch)  (the last stage returns the scalar loss)

where ``P_i`` is the tuple of the parameter *groups* stage ``i`` uses (a group
may be used by several stages: a head tied to the token embedding uses the
embedding's group). The forward pass keeps each stage's input ``x_i`` and
nothing else; the backward pass of stage ``i`` recomputes ``f_i`` under
``jax.vjp`` (activation checkpointing per stage, as ``jax.checkpoint`` per
block does) and returns the cotangent of ``x_i`` and the gradients of
``P_i``, added in place to a running sum where one exists (micro-batches,
groups used by several stages).

Gradients therefore become ready stage by stage, the last stage first, each
group's complete gradient as soon as the backward pass has passed the first
stage that uses it (:attr:`StagedModel.completion`). That is what lets the
optimizer start on them while the backward pass continues
(``jax_dos.overlap``).

A step of ``k`` micro-batches runs its programs in one of two orders
(:func:`schedule`):

* ``"stage"``: every micro-batch through stage ``i`` before stage ``i + 1``
  (forward), and through stage ``i`` before stage ``i - 1`` (backward). A
  group's gradient is then complete once the one backward pass has passed
  its stage, so the optimizer's window is the whole backward pass. The
  forward pass keeps ``k`` micro-batches' stage inputs at once.
* ``"batch"``: micro-batch after micro-batch, each a whole forward and
  backward pass (the plain accumulated step's order). Gradients are complete
  only in the last micro-batch's backward pass; one micro-batch's stage
  inputs are kept at a time.

Each group's gradients are summed over the micro-batches in micro-batch
order in both; a group used by two stages (a tied head) adds its two stages'
terms in the order the schedule runs them.

The backward program of the stage completing a group also returns the sum of
squares of that group's gradient, in float32, for the global norm.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_dos import memory
from jax_dos.timeline import MICRO_BATCH_ORDERS, StageTimes


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage: ``fn(params, x, batch) -> y`` over the parameter groups ``groups`` (indices).

  ``params`` is the tuple of those groups' trees, in ``groups`` order. The
  first stage gets ``x = None``; the last returns the scalar loss. Use the
  same ``fn`` object for identical stages (transformer blocks): each distinct
  ``fn`` compiles its own programs.
  """

  fn: Callable[[tuple, Any, Any], Any]
  groups: tuple[int, ...]

  def __post_init__(self):
    groups = tuple(self.groups)
    if not groups or len(set(groups)) != len(groups) or any(not isinstance(g, int) or g < 0 for g in groups):
      raise ValueError(f"a Stage's groups must be distinct group indices >= 0, at least one; got {self.groups!r}.")
    object.__setattr__(self, "groups", groups)


def _sum_of_squares(tree: Any) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.float32(0))


def _forward(fn, params, x, batch):
  return fn(params, x, batch)


def _backward(fn, complete: tuple[bool, ...], params, x, batch, dy, sums):
  """``(loss or None, new sums, dx or None, sums of squares of the completed groups)`` for one stage."""
  if x is None:
    y, vjp = jax.vjp(lambda p: fn(p, None, batch), params)
    (grads,), dx = vjp(jnp.ones_like(y) if dy is None else dy), None
  else:
    y, vjp = jax.vjp(lambda p, x: fn(p, x, batch), params, x)
    grads, dx = vjp(jnp.ones_like(y) if dy is None else dy)
  new = tuple(g if s is None else jax.tree.map(jnp.add, s, g) for s, g in zip(sums, grads))
  squares = tuple(_sum_of_squares(t) for t, c in zip(new, complete) if c)
  return (y if dy is None else None), new, dx, squares


def schedule(stages: int, micro_batches: int, order: str) -> list[tuple[str, int, int]]:
  """A step's programs in dispatch order: ``(kind, stage, micro_batch)``, ``kind`` ``"forward"`` or ``"backward"``.

  The last stage has no forward program (its backward pass computes the
  loss). In both orders stage ``i``'s backward program of the last
  micro-batch (``micro_batches - 1``) is the one that completes the groups
  ``i`` completes.
  """
  if order not in MICRO_BATCH_ORDERS:
    raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {order!r}.")
  forward = lambda m: [("forward", i, m) for i in range(stages - 1)]  # noqa: E731
  backward = lambda m: [("backward", i, m) for i in reversed(range(stages))]  # noqa: E731
  if order == "batch":
    return [p for m in range(micro_batches) for p in (*forward(m), *backward(m))]
  stage_major = lambda programs: [(kind, i, m) for kind, i, _ in programs for m in range(micro_batches)]  # noqa: E731
  return stage_major(forward(0)) + stage_major(backward(0))


def micro_batch(batch: Any, m: int, micro_batches: int) -> Any:
  """Micro-batch ``m`` of ``micro_batches`` equal consecutive parts of ``batch`` along its leading axis."""
  if micro_batches == 1:
    return batch
  n = jax.tree.leaves(batch)[0].shape[0] // micro_batches
  return jax.tree.map(lambda x: x[m * n : (m + 1) * n], batch)


# One jitted wrapper per program kind, the stage function a static argument: every StagedModel of the same stages
# (the one that measures their times, the overlapped step's) shares the compiled programs.
_jit_forward = jax.jit(_forward, static_argnums=0)
# dy is dead after its stage's backward and dx is written into it; the running sums are updated in place.
_jit_backward = jax.jit(_backward, static_argnums=(0, 1), donate_argnums=(5, 6))
# A stage whose dx cannot take dy's buffers (the first stage has no dx; another whose input differs in shape or
# dtype from its output) keeps dy: a donated buffer no output reuses is not freed any sooner, and jax warns of it.
_jit_backward_keep_dy = jax.jit(_backward, static_argnums=(0, 1), donate_argnums=(6,))


def _same_types(a: Any, b: Any) -> bool:
  """Whether trees ``a`` and ``b`` have one structure and leaves of equal shapes and dtypes (one buffer fits both)."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


class StagedModel:
  """The stages of a model over ``num_groups`` parameter groups, and their jitted programs.

  Attributes:
    stages: the stages, in forward order.
    completion: for each group, the stage whose backward pass completes its
      gradient (the first stage that uses it).
  """

  def __init__(self, stages: Sequence[Stage], num_groups: int):
    self.stages = tuple(stages)
    if len(self.stages) < 2:
      raise ValueError("a staged model needs at least two stages (the first reads the batch, the last the loss).")
    for i, st in enumerate(self.stages):
      if not isinstance(st, Stage):
        raise TypeError(f"stage {i} is a {type(st).__name__}; give jax_dos.Stage(fn, groups) objects.")
      if max(st.groups) >= num_groups:
        raise ValueError(f"stage {i} uses group {max(st.groups)} but the parameters have {num_groups} groups.")
    used = [[i for i, st in enumerate(self.stages) if g in st.groups] for g in range(num_groups)]
    unused = [g for g, u in enumerate(used) if not u]
    if unused:
      raise ValueError(f"parameter groups {unused} are used by no stage; every group must belong to a stage.")
    self.completion = tuple(min(u) for u in used)

  def groups_completing(self, stage: int) -> tuple[int, ...]:
    """The groups whose gradient is complete once ``stage``'s backward pass has run."""
    return tuple(g for g in self.stages[stage].groups if self.completion[g] == stage)

  def forward(self, stage: int, params: tuple, x: Any, batch: Any) -> Any:
    """Stage ``stage``'s output (dispatched asynchronously)."""
    st = self.stages[stage]
    return _jit_forward(st.fn, params, x, batch)

  def backward(
    self, stage: int, params: tuple, x: Any, batch: Any, dy: Any, sums: tuple, last: bool
  ) -> tuple[Any, tuple, Any, tuple]:
    """Stage ``stage``'s backward pass; ``sums`` are consumed, and ``dy`` where ``dx`` can take its buffers.

    ``dy`` is ``None`` for the last stage (whose output is the loss), and
    ``sums`` holds, per group of the stage, the running gradient sum or
    ``None``. ``dy`` is donated (its buffers become ``dx``'s) where ``x`` and
    ``dy`` match in structure, shapes and dtypes; the first stage's (no
    ``dx``) and any other's is kept, for the caller to drop. Returns
    ``(loss, sums, dx, squares)``: the loss for the last stage (else
    ``None``), the new sums, the cotangent of ``x`` (``None`` for the first
    stage) and, with ``last`` (the last micro-batch), the float32 sums of
    squares of the groups this stage completes.
    """
    st = self.stages[stage]
    complete = tuple(last and self.completion[g] == stage for g in st.groups)
    program = _jit_backward if dy is None or (x is not None and _same_types(x, dy)) else _jit_backward_keep_dy
    return program(st.fn, complete, params, x, batch, dy, tuple(sums))

  def loss_and_grads(
    self, groups: Sequence[Any], batch: Any, micro_batches: int = 1, order: str = "stage"
  ) -> tuple[jax.Array, list]:
    """``(mean loss, summed grads)`` of one step, with no optimizer: the gradients the overlapped step uses.

    ``batch`` is split into ``micro_batches`` equal parts; each group's
    gradient is the sum over them, added in the order of :func:`schedule`'s
    ``order`` by the very programs the overlapped step runs (the last
    micro-batch's also square the complete gradients). On a GPU, two programs
    computing the same gradient may pick different matmul algorithms and
    round it differently.
    """
    n, k = len(self.stages), micro_batches
    parts = [micro_batch(batch, m, k) for m in range(k)]
    inputs = [[None] * n for _ in range(k)]
    sums: list[Any] = [None] * len(groups)
    dys, losses = [None] * k, [None] * k
    for kind, i, m in schedule(n, k, order):
      st = self.stages[i]
      params = tuple(groups[g] for g in st.groups)
      if kind == "forward":
        inputs[m][i + 1] = self.forward(i, params, inputs[m][i], parts[m])
        continue
      out, new, dys[m], _ = self.backward(i, params, inputs[m][i], parts[m], dys[m],
                                          tuple(sums[g] for g in st.groups), last=m == k - 1)  # fmt: skip
      inputs[m][i] = None
      losses[m] = out if out is not None else losses[m]
      for g, s in zip(st.groups, new):
        sums[g] = s
    return (losses[0] if k == 1 else sum(losses) / k), sums

  def measure_times(self, groups: Sequence[Any], batch: Any) -> StageTimes:
    """Each stage's forward and backward time on ``batch`` (one micro-batch), run one stage at a time, and the
    bytes (per device) of the stage inputs its forward pass keeps.

    A first pass compiles; the second is timed, waiting for each program.
    The parameters are committed first, as the overlapped step commits them:
    the programs compiled here are then the step's.
    """
    groups = memory.committed(list(groups))
    n = len(self.stages)
    for _ in range(2):  # the first pass compiles
      fwd, bwd, xs, x = [], [], [], None
      for i in range(n):
        xs.append(x)
        t = time.perf_counter()
        if i < n - 1:
          x = jax.block_until_ready(self.forward(i, tuple(groups[g] for g in self.stages[i].groups), x, batch))
        fwd.append(time.perf_counter() - t)
      kept = sum(memory.device_elements(a) * a.dtype.itemsize for a in jax.tree.leaves(xs))
      sums: list[Any] = [None] * len(groups)
      dy = None
      for i in reversed(range(n)):
        st = self.stages[i]
        t = time.perf_counter()
        _, new, dy, _ = jax.block_until_ready(self.backward(i, tuple(groups[g] for g in st.groups), xs[i], batch, dy,
                                                            tuple(sums[g] for g in st.groups), last=True))  # fmt: skip
        bwd.append(time.perf_counter() - t)
        xs[i] = None
        for g, s in zip(st.groups, new):
          sums[g] = s
      del sums
    return StageTimes(tuple(fwd), tuple(reversed(bwd)), kept)
