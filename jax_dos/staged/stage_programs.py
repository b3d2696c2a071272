"""A stage's jitted programs: its forward program, and its backward program that sums its gradients in place.

The forward program runs ``f_i(P_i, x_i, batch)``, and under a policy other than ``"full"`` also returns the
residuals that policy saves (``remat.Saved``); the backward program recomputes the stage (``"full"``) or applies the
saved vjp function, adds the gradients of ``P_i`` to the running sums (laid out as :func:`gradient_layouts` says),
returns the cotangent of ``x_i``, the sums of squares of the groups it completes and, where asked, the next stage's
sharded weights gathered whole (``jax_dos.staged.gather_ahead``). One jitted wrapper a program kind, the stage function
a static argument, so every ``StagedModel`` of the same stages shares the compiled programs (``jax_dos.staged.stages``:
the model as a chain of them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos.core import partition
from jax_dos.staged.remat import Saved, check_policy, rematerialise


@dataclasses.dataclass(frozen=True)
class Stage:
  """One stage: ``fn(params, x, batch) -> y`` over the parameter groups ``groups`` (indices).

  ``params`` is the tuple of those groups' trees, in ``groups`` order. The
  first stage gets ``x = None``; the last returns the scalar loss. Use the
  same ``fn`` object for identical stages (transformer blocks): each distinct
  ``fn`` compiles its own programs. ``remat`` is the stage's
  rematerialisation policy (``jax_dos.staged.remat.REMAT_POLICIES``; the module
  docstring says what each keeps); an overlapped step's plan may choose
  another (``Plan.remat``).

  ``inputs``: what the stage reads beside them and is not trained (random
  keys and counters, a layer's index), or ``None``. A stage with ``inputs``
  is called ``fn(params, x, batch, inputs.at(m))`` for micro-batch ``m`` of
  the coming step (a tree of arrays, the same in the micro-batch's forward
  and backward programs: a recomputed forward draws the same random numbers),
  and ``inputs.advance(micro_batches)`` once a step's programs are dispatched
  (``jax_dos.staged.stage_rng``: an NNX model's RNG streams).
  """

  fn: Callable[..., Any]
  groups: tuple[int, ...]
  remat: str = "full"
  inputs: Any = None

  def __post_init__(self):
    groups = tuple(self.groups)
    if not groups or len(set(groups)) != len(groups) or any(not isinstance(g, int) or g < 0 for g in groups):
      raise ValueError(f"a Stage's groups must be distinct group indices >= 0, at least one; got {self.groups!r}.")
    object.__setattr__(self, "groups", groups)
    check_policy(self.remat)


def _sum_of_squares(tree: Any) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)), jnp.float32(0))


def _forward(fn, params, x, batch, inputs):
  return fn(params, x, batch) if inputs is None else fn(params, x, batch, inputs)


def _stage_vjp(fn, policy: str, params, x, batch, inputs) -> tuple[Any, Callable]:
  """``jax.vjp`` of the stage under ``policy``, over the parameters (and ``x``, where the stage has one)."""
  if x is None:
    return jax.vjp(rematerialise(lambda p: _forward(fn, p, None, batch, inputs), policy), params)
  return jax.vjp(rematerialise(lambda p, x: _forward(fn, p, x, batch, inputs), policy), params, x)


def _forward_saving(fn, policy: str, params, x, batch, inputs):
  """``(y, Saved)``: the stage's output and the residuals ``policy`` keeps for its backward program."""
  y, vjp = _stage_vjp(fn, policy, params, x, batch, inputs)
  leaves, treedef = jax.tree.flatten(vjp)
  # A constant the stage closes over (a numpy table) becomes a saved array like any other residual.
  leaves = [jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a for a in leaves]
  if not all(isinstance(a, jax.Array) for a in leaves):
    raise TypeError(
      f"this jax ({jax.__version__}) returns a vjp function that is not a tree of arrays, so a stage's forward program"
      f" cannot hand its residuals to its backward program; use remat='full' for the stages (--remat full)."
    )
  where = {id(a): j for j, a in enumerate(jax.tree.leaves((params, x, batch, inputs)))}
  sources = tuple(where.get(id(a), -1) for a in leaves)
  return y, Saved(tuple(a for a, s in zip(leaves, sources) if s < 0), treedef, sources)


def _backward(fn, complete: tuple[bool, ...], layouts, params, x, batch, dy, sums, inputs, ahead, whole):
  """``(loss or None, new sums, dx or None, sums of squares of the completed groups, ahead gathered)`` for one
  stage: ``ahead`` (sharded leaves of the next stage's weights) are gathered into ``whole`` (their shardings)."""
  y, vjp = _stage_vjp(fn, "none", params, x, batch, inputs)
  out = _summed(vjp(jnp.ones_like(y) if dy is None else dy), x, complete, layouts, sums, y if dy is None else None)
  return (*out, _gathered(ahead, whole))


def _backward_saved(fn, complete, layouts, params, x, batch, dy, sums, saved: Saved, inputs, ahead, whole):
  """:func:`_backward` of a stage whose forward program kept ``saved``: nothing it saved is recomputed."""
  del fn
  return (*_summed(saved.vjp(params, x, batch, inputs)(dy), x, complete, layouts, sums, None), _gathered(ahead, whole))


def _gathered(ahead: tuple, whole: tuple) -> tuple:
  """``ahead`` laid out as ``whole`` says: an all-gather each, which nothing else in the program waits for."""
  return tuple(jax.lax.with_sharding_constraint(a, s) for a, s in zip(ahead, whole))


def _laid_out(tree: Any, layout: tuple | None) -> Any:
  """``tree`` constrained to ``layout`` (its leaves' shardings, flat); as it is where ``layout`` is ``None``."""
  if layout is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, jax.tree.unflatten(jax.tree.structure(tree), list(layout)))


def _summed(cotangents, x, complete, layouts, sums, loss):
  (grads, dx) = (cotangents[0], None) if x is None else cotangents
  grads = tuple(_laid_out(g, lay) for g, lay in zip(grads, layouts))
  new = tuple(g if s is None else jax.tree.map(jnp.add, s, g) for s, g in zip(sums, grads))
  squares = tuple(_sum_of_squares(t) for t, c in zip(new, complete) if c)
  return loss, new, dx, squares


# One jitted wrapper per program kind, the stage function a static argument: every StagedModel of the same stages
# (the one that measures their times, the overlapped step's) shares the compiled programs.
_jit_forward = jax.jit(_forward, static_argnums=0)
_jit_forward_saving = jax.jit(_forward_saving, static_argnums=(0, 1))
# dy is dead after its stage's backward and dx is written into it; the running sums are updated in place.
# The weights gathered ahead are not donated: the stage's programs of the other micro-batches still read them.
_jit_backward = jax.jit(_backward, static_argnums=(0, 1, 2, 10), donate_argnums=(6, 7))
# A stage whose dx cannot take dy's buffers (the first stage has no dx; another whose input differs in shape or
# dtype from its output) keeps dy: a donated buffer no output reuses is not freed any sooner, and jax warns of it.
_jit_backward_keep_dy = jax.jit(_backward, static_argnums=(0, 1, 2, 10), donate_argnums=(7,))
# The saved residuals are not donated: no output takes their shapes, and they are freed once the program has run.
_jit_backward_saved = jax.jit(_backward_saved, static_argnums=(0, 1, 2, 11), donate_argnums=(6, 7))
_jit_backward_saved_keep_dy = jax.jit(_backward_saved, static_argnums=(0, 1, 2, 11), donate_argnums=(7,))


def forward_call(st: Stage, params: tuple, x: Any, batch: Any, inputs: Any = None) -> tuple[Any, Saved | None]:
  if st.remat == "full":
    return _jit_forward(st.fn, params, x, batch, inputs), None
  return _jit_forward_saving(st.fn, st.remat, params, x, batch, inputs)


def gradient_layouts(params: tuple, partitioned: bool, gathered: bool = False) -> tuple:
  """Per group of ``params`` (a stage's), the shardings (flat) its gradients take in the stage's backward program:
  with ``partitioned``, on a mesh, the partitioned state's (``partition.state_shardings``: a replicated
  parameter's gradients are reduce-scattered, each device keeping the sum of its share); else ``None`` (XLA's
  choice, the parameters' own: all-reduced), or with ``gathered`` (the program takes the weights gathered whole,
  ``jax_dos.staged.gather_ahead``) the parameters' own shardings, named: their gradients reduce-scattered into them."""
  if not partitioned and not gathered:
    return (None,) * len(params)
  layouts = []
  for tree in params:
    leaves = jax.tree.leaves(tree)
    meshed = leaves and all(isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) for x in leaves)
    if not meshed:
      layouts.append(None)
    elif partitioned:
      layouts.append(tuple(jax.tree.leaves(partition.state_shardings(leaves))))
    else:
      layouts.append(tuple(x.sharding.with_memory_kind("device") for x in leaves))
  return tuple(layouts)


def backward_call(
  st: Stage, complete: tuple[bool, ...], params, x, batch, dy, sums, saved, layouts: tuple | None = None, inputs=None,
  ahead: tuple = (), whole: tuple = (),
) -> tuple[Callable, tuple]:  # fmt: skip
  """The jitted backward program for stage ``st`` and its arguments (to run, or to lower for its memory);
  ``layouts``: :func:`gradient_layouts`' (``None``: each group's as XLA likes); ``inputs``: the stage's
  (``Stage.inputs``); ``ahead``: leaves to gather into the shardings ``whole``, returned last."""
  layouts = (None,) * len(st.groups) if layouts is None else layouts
  donate = dy is None or (x is not None and _same_types(x, dy))
  if saved is not None:
    program = _jit_backward_saved if donate else _jit_backward_saved_keep_dy
    return program, (st.fn, complete, layouts, params, x, batch, dy, tuple(sums), saved, inputs, ahead, whole)
  program = _jit_backward if donate else _jit_backward_keep_dy
  return program, (st.fn, complete, layouts, params, x, batch, dy, tuple(sums), inputs, ahead, whole)


def _same_types(a: Any, b: Any) -> bool:
  """Whether trees ``a`` and ``b`` have one structure and leaves of equal shapes and dtypes (one buffer fits both)."""
  if jax.tree.structure(a) != jax.tree.structure(b):
    return False
  return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
