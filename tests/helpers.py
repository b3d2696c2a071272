"""Shared test helpers: random parameter trees, comparison against optax, and tiny runs of ``train.gpt``."""

from __future__ import annotations

import os
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_dos
from jax_dos.memory import cpu_client
from jax_dos.optimizer.interleaved import find_interleaved
from train import gpt

SHAPES = {
  "embed": (13, 8),
  "blocks": [{"w": (8, 8), "b": (8,)}, {"w": (8, 16), "b": (16,)}],
  "scale": (),
  "empty": (0, 3),
}

# A model small enough that each run takes seconds on a CPU.
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--batch", "4", "--seq-len", "32", "--eval-batches", "1",
        "--quiet"]  # fmt: skip


def cpu_devices_env(devices: int, **extra: str) -> dict[str, str]:
  """This process's environment for an interpreter of ``devices`` CPU devices: ``XLA_FLAGS`` keeps the run's flags
  (``conftest.COMPILE_FLAGS``) and adds the device count, and XLA's CPU client gets enough pool threads for them
  (``PJRT_NPROC``, as ``jax_dos.configure_process`` sets it: importing jax_dos sets nothing)."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags, **extra)
  env.setdefault(cpu_client.POOL_ENV, str(cpu_client.pool_threads(devices)))
  return env


def cache_calibration(home, calibration):
  """``home`` made an ``XDG_CACHE_HOME`` holding ``calibration``: a script run with it plans from the cached rates
  instead of measuring them again (``conftest.calibrated_cache``); ``home``."""
  from jax_dos.planning import calibration as C

  C.save(calibration, home / "jax_dos" / C.cache_path(calibration.key).name)
  return home


def random_tree(rng: np.random.Generator, shapes=SHAPES, dtype=jnp.float32, scale: float = 1.0):
  """A tree of ``shapes`` filled with fresh normal samples."""
  return jax.tree.map(
    lambda s: jnp.asarray(scale * rng.standard_normal(s), dtype), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


def train_tiny(tmp_path, name: str, *flags: str) -> dict:
  """``python -m train.gpt`` in this process on the ``TINY`` model, writing to ``tmp_path / name``; its result."""
  return gpt.main([*TINY, "--out", str(tmp_path / name), *flags])


def same_tree(a, b) -> bool:
  """Whether ``a`` and ``b`` have one structure and their leaves are equal bit for bit, in the same dtypes."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


def max_rel_diff(a, b) -> float:
  """Max |a - b| over all leaves, relative to the largest |b| (at least 1)."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if np.size(x) == 0:
      continue
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y))))))
  return worst


def run_pair(tx, ref, params, steps: int, rng: np.random.Generator, *, jit: bool, grad_dtype=None, ref_params=None):
  """Runs ``tx`` and the optax reference side by side on the same fresh gradients.

  Returns ``(params, state, ref_params, ref_state)``.
  """
  ref_params = params if ref_params is None else ref_params
  state, ref_state = tx.init(params), ref.init(ref_params)
  update = jit_traced(tx, tx.update) if jit else tx.update
  for _ in range(steps):
    grads = random_tree(rng, jax.tree.map(jnp.shape, ref_params), dtype=grad_dtype or jnp.float32)
    grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, ref_params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = ref.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  return params, state, ref_params, ref_state


def jitted(ref: optax.GradientTransformation) -> optax.GradientTransformation:
  """A reference optimizer with its update jitted: ``optax.MultiSteps`` called eagerly compiles its ``lax.cond`` of
  fresh branches on every call, jitted once."""
  return optax.GradientTransformation(ref.init, jax.jit(ref.update))


_WARNED: weakref.WeakSet = weakref.WeakSet()  # optimizers whose TracedUpdateWarning a jit_traced call has seen


def jit_traced(tx, fn):
  """``jax.jit(fn)`` for a test that traces ``tx``'s update on purpose, ``fn(grads, state, params, ...)``.

  Expects what jax_dos says of it: one ``jax_dos.TracedUpdateWarning`` at the first traced call where ``tx``'s plan
  offloads state (none for an all-device plan), none after that for the same optimizer. Other warnings pass on.
  """
  jitted = jax.jit(fn)

  def call(grads, state, params, *args, **kwargs):
    opt = find_interleaved(tx, params, "jit_traced")[0]  # tx itself or a chain containing it
    offloaded = any(p != "device" for p in jax_dos.get_plan(tx, params).placements)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", jax_dos.TracedUpdateWarning)
      out = jitted(grads, state, params, *args, **kwargs)
    said = [w for w in caught if issubclass(w.category, jax_dos.TracedUpdateWarning)]
    assert len(said) == int(offloaded and opt not in _WARNED), [str(w.message) for w in said]
    if said:
      _WARNED.add(opt)
    for w in caught:
      if w not in said:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out

  return call
