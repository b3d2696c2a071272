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

from jax_dos.timeline import StageTimes


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


# One jitted wrapper per program kind, the stage function a static argument: every StagedModel of the same stages
# (the one that measures their times, the overlapped step's) shares the compiled programs.
_jit_forward = jax.jit(_forward, static_argnums=0)
# dy is dead after its stage's backward; the running sums are updated in place.
_jit_backward = jax.jit(_backward, static_argnums=(0, 1), donate_argnums=(5, 6))


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
    """Stage ``stage``'s backward pass; ``dy`` and ``sums`` are consumed.

    ``dy`` is ``None`` for the last stage (whose output is the loss), and
    ``sums`` holds, per group of the stage, the running gradient sum or
    ``None``. Returns ``(loss, sums, dx, squares)``: the loss for the last
    stage (else ``None``), the new sums, the cotangent of ``x`` (``None`` for
    the first stage) and, with ``last`` (the last micro-batch), the float32
    sums of squares of the groups this stage completes.
    """
    st = self.stages[stage]
    complete = tuple(last and self.completion[g] == stage for g in st.groups)
    return _jit_backward(st.fn, complete, params, x, batch, dy, tuple(sums))

  def loss_and_grads(
    self, groups: Sequence[Any], batch: Any, sums: Sequence[Any] | None = None, last: bool = False
  ) -> tuple[jax.Array, list]:
    """``(loss, grads)`` of one batch, stage by stage with no optimizer: the gradients the overlapped step uses.

    With ``sums`` (the gradients of earlier micro-batches; consumed) the
    gradients are added to them in the order the overlapped step adds them.
    ``last=True`` runs the backward programs of a step's last micro-batch
    (those that also square the complete gradients): the very programs the
    overlapped step runs there. On a GPU, two programs computing the same
    gradient may pick different matmul algorithms and round it differently.
    """
    xs, x = [], None
    for i in range(len(self.stages) - 1):
      xs.append(x)
      x = self.forward(i, tuple(groups[g] for g in self.stages[i].groups), x, batch)
    xs.append(x)
    sums = [None] * len(groups) if sums is None else list(sums)
    dy, loss = None, None
    for i in reversed(range(len(self.stages))):
      st = self.stages[i]
      out, new, dy, _ = self.backward(i, tuple(groups[g] for g in st.groups), xs[i], batch, dy,
                                      tuple(sums[g] for g in st.groups), last=last)  # fmt: skip
      xs[i] = None
      loss = out if out is not None else loss
      for g, s in zip(st.groups, new):
        sums[g] = s
    return loss, sums

  def measure_times(self, groups: Sequence[Any], batch: Any) -> StageTimes:
    """Each stage's forward and backward time on ``batch`` (one micro-batch), run one stage at a time.

    A first pass compiles; the second is timed, waiting for each program.
    """
    n = len(self.stages)
    for _ in range(2):  # the first pass compiles
      fwd, bwd, xs, x = [], [], [], None
      for i in range(n):
        xs.append(x)
        t = time.perf_counter()
        if i < n - 1:
          x = jax.block_until_ready(self.forward(i, tuple(groups[g] for g in self.stages[i].groups), x, batch))
        fwd.append(time.perf_counter() - t)
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
    return StageTimes(tuple(fwd), tuple(reversed(bwd)))
