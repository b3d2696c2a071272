"""Gradient accumulation that keeps offloaded optimizer state on the fast path.

``optax.MultiSteps`` chooses between the old and the new inner state with an
elementwise ``jnp.where`` inside ``lax.cond``. JAX cannot select between arrays
in ``pinned_host`` memory (``select_n`` needs every operand in one memory
space, and the predicate lives on the accelerator), so ``optax.MultiSteps``
works with ``plan="device"`` only. :func:`multi_steps` computes the same
numbers (Welford mean of the mini-batch gradients, the inner update every
``k``-th call, zero updates otherwise) without selecting on the state:

* eagerly, the branch is a Python ``if`` and the inner update runs on the
  engine (the fast path) every ``k`` calls;
* traced, the inner state passes through ``lax.cond`` unchanged in the
  skipping branch, which keeps its memory kind.

The state is an ``optax.MultiStepsState`` (``skip_state=()``), so
``optax.MultiSteps(...).has_updated`` reads it too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jax_dos.memory import kinds as memory
from jax_dos.optimizer.interleaved import shapes_only


def _welford(grads, acc, mini_step):
  return jax.tree.map(lambda g, a: a + (g.astype(a.dtype) - a) / (mini_step + 1).astype(a.dtype), grads, acc)


_jit_welford = jax.jit(_welford, donate_argnums=1)
_jit_zeros_like = jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))


def multi_steps(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformationExtraArgs:
  """Applies ``inner`` to the mean of every ``every_k`` gradients; as ``optax.MultiSteps``.

  Returns zero updates on the other calls. ``every_k`` is a constant integer.
  """
  if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
    raise ValueError(f"every_k must be an integer >= 1, got {every_k!r}.")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return optax.MultiStepsState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=jnp.zeros([], jnp.int32),
      inner_opt_state=inner.init(params),
      acc_grads=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
      skip_state=(),
    )

  def update(updates, state, params=None, **extra_args):
    leaves = jax.tree.leaves((updates, state.mini_step, state.acc_grads, params))
    if any(memory.is_traced(x) for x in leaves):
      return _traced_update(updates, state, params, **extra_args)
    acc = _jit_welford(updates, state.acc_grads, state.mini_step)
    if int(state.mini_step) < every_k - 1:
      with shapes_only():  # the inner update's output shapes: nothing runs, so no TracedUpdateWarning
        zeros = jax.eval_shape(
          lambda a, s, p: inner.update(optax.tree.cast_like(a, updates), s, p, **extra_args)[0],
          acc,
          state.inner_opt_state,
          params,
        )
      new_updates = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), zeros)
      return new_updates, state._replace(mini_step=state.mini_step + 1, acc_grads=acc)
    new_updates, inner_state = inner.update(
      optax.tree.cast_like(acc, updates), state.inner_opt_state, params, **extra_args
    )
    return new_updates, optax.MultiStepsState(
      mini_step=jnp.zeros([], jnp.int32),
      gradient_step=optax.safe_increment(state.gradient_step),
      inner_opt_state=inner_state,
      acc_grads=_jit_zeros_like(acc),
      skip_state=(),
    )

  def _traced_update(updates, state, params, **extra_args):
    acc = _welford(updates, state.acc_grads, state.mini_step)
    emit = state.mini_step == every_k - 1

    def apply(acc, inner_state, params):
      return inner.update(optax.tree.cast_like(acc, updates), inner_state, params, **extra_args)

    def skip(acc, inner_state, params):
      # Both branches must agree on memory spaces, so pass the state through to the spaces `apply` returns.
      closed, shapes = jax.make_jaxpr(apply, return_shape=True)(acc, inner_state, params)
      spaces = jax.tree.unflatten(jax.tree.structure(shapes), closed.out_avals)
      zeros = jax.tree.map(lambda z: jnp.zeros(z.shape, z.dtype), shapes[0])
      return zeros, jax.tree.map(memory.traced_put_like, inner_state, spaces[1])

    new_updates, inner_state = jax.lax.cond(emit, apply, skip, acc, state.inner_opt_state, params)
    return new_updates, optax.MultiStepsState(
      mini_step=jnp.where(emit, 0, state.mini_step + 1).astype(jnp.int32),
      gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step), state.gradient_step),
      inner_opt_state=inner_state,
      acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc),
      skip_state=(),
    )

  return optax.GradientTransformationExtraArgs(init, update)
