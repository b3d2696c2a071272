"""The recursions jax_dos claims to compute, run with optax: what the tests and ``bench/analysis`` compare against.

Each step runs an optax transformation (``optax.adamw``) on float32 master
weights, and hands the forward pass of the next step, leaf by leaf, one of:

* the new masters: optax's own trajectory (no delay);
* from step ``warmup`` on, for the leaves marked ``delayed``: the masters
  *before* the latest update (``delay=1``: the one-step delayed recursion), or
  a prediction made from the state before the update (``delay_predict=
  "moments"``: :func:`adamw_prediction`).

The parameters handed on are those values cast to each parameter's dtype.
Nothing here imports jax_dos. The benchmarks import this file by putting
``tests/`` on their path, as pytest does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

# (t, masters before step t's update, optax's Adam state before it) -> a tree of predicted masters
Predictor = Callable[[int, Any, optax.ScaleByAdamState], Any]


class Scaled(NamedTuple):
  """Gradients and a scalar factor (a clip's ``grad_scale``) that the update multiplies them by, as jax_dos does."""

  grads: Any
  scale: Any


class Step(NamedTuple):
  """One step of the recursion: the parameters handed on, the masters and optax's state after it."""

  params: Any
  masters: Any
  state: Any


class Trajectory(NamedTuple):
  """The parameters handed on after each step, and the masters and optax's state after the last one."""

  params: list
  masters: Any
  state: Any


def adam_state(state: Any) -> optax.ScaleByAdamState:
  """The ``ScaleByAdamState`` inside an optax state (``optax.adamw``'s first element)."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
  (found,) = [x for x in jax.tree.leaves(state, is_leaf=is_adam) if is_adam(x)]
  return found


def adamw_steps(
  params: Any,
  grads_at: Callable[[int, Any], Any],
  *,
  tx: optax.GradientTransformation,
  delayed: Union[bool, Sequence[bool]] = False,
  warmup: int = 0,
  predict: Optional[Predictor] = None,
  jit: bool = False,
) -> Iterator[Step]:
  """The recursion, one :class:`Step` at a time (endless: the caller stops it).

  Args:
    params: the initial parameters; the masters start as their float32 values.
    grads_at: ``(t, params) -> gradients`` of step ``t`` at the parameters
      handed on, or :class:`Scaled` gradients; cast to float32 (and scaled)
      inside the update.
    tx: the optax transformation run on the masters.
    delayed: per leaf (flatten order), or for every leaf, whether it is
      handed something other than its new master from step ``warmup`` on.
    warmup: the first delayed step.
    predict: ``None``: delayed leaves get the masters before the update; else
      they get ``predict(t, masters_before, adam_state_before)``'s leaves
      (called at every step, so that it may keep history).
    jit: jit the update (for a real model, where eager optax is slow).
  """
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state = tx.init(masters)
  leaves, treedef = jax.tree.flatten(params)
  flags = [delayed] * len(leaves) if isinstance(delayed, bool) else list(delayed)

  def update(masters, state, grads, scale):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) if scale is None else g.astype(jnp.float32) * scale, grads)
    updates, state = tx.update(grads, state, masters)
    return optax.apply_updates(masters, updates), state

  update = jax.jit(update) if jit else update
  for t in range(2**62):
    grads = grads_at(t, params)
    grads, scale = (grads.grads, grads.scale) if isinstance(grads, Scaled) else (grads, None)
    before, adam_before = masters, adam_state(state)
    masters, state = update(masters, state, grads, scale)
    stale = before if predict is None else predict(t, before, adam_before)
    handed = [
      s if flag and t >= warmup else m
      for s, m, flag in zip(jax.tree.leaves(stale), jax.tree.leaves(masters), flags, strict=True)
    ]
    params = jax.tree.unflatten(treedef, [jnp.asarray(x, p.dtype) for x, p in zip(handed, jax.tree.leaves(params))])
    yield Step(params, masters, state)


def adamw_trajectory(params: Any, grads_at: Callable[[int, Any], Any], steps: int, **kwargs) -> Trajectory:
  """:func:`adamw_steps` run for ``steps`` steps: the parameters after each, and the final masters and state."""
  history, last = [], None
  for _, last in zip(range(steps), adamw_steps(params, grads_at, **kwargs)):
    history.append(last.params)
  return Trajectory(history, last.masters, last.state)


def adamw_prediction(
  lr: float, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.1
) -> Predictor:
  """``delay_predict="moments"`` in numpy: one more AdamW step (constant ``lr``) with the moments as they are.

  From the state before step ``t``: ``x - lr ((m / (1 - b1^(t+1))) / (sqrt(v / (1 - b2^(t+1))) + eps) + wd x)``,
  in float32, weight decay on every leaf.
  """
  f32 = np.float32

  def predict(t: int, masters: Any, adam: optax.ScaleByAdamState) -> Any:
    bc1, bc2 = f32(1 - b1 ** (t + 1)), f32(1 - b2 ** (t + 1))

    def leaf(x, m, v):
      x, m, v = (np.asarray(a, f32) for a in (x, m, v))
      u = (m / bc1) / (np.sqrt(v / bc2) + f32(eps)) + f32(weight_decay) * x
      return x + f32(-lr) * u

    return jax.tree.map(leaf, masters, adam.mu, adam.nu)

  return predict
