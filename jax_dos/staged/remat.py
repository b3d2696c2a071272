"""Rematerialisation policies: what a block's forward pass keeps for its backward pass, by name.

The names are the user's interface (``train.gpt --remat``,
``jax_dos.Stage(..., remat=...)``); each is a ``jax.checkpoint`` policy over
the matmul outputs a model tags with ``jax.ad_checkpoint.checkpoint_name``
under the names of :data:`REMAT_NAMES`:

* ``"full"``: keep the block's input only and recompute the rest in the
  backward pass (``jax.checkpoint``'s default: nothing saveable);
* ``"minimal"``: keep the outputs of the large matmuls (the names of
  :data:`REMAT_NAMES`) and recompute the cheap rest (norms, activations,
  attention), as MaxText's ``remat_policy``;
* ``"none"``: keep everything the backward pass needs (no ``jax.checkpoint``);
* ``"offload"``: keep the large matmuls' outputs in pinned host memory
  (``save_and_offload_only_these_names``), copied back for the backward pass.

A policy changes what is computed twice, never the numbers: the gradients are
the same function of the same values.

On a mesh of GPUs a program that rematerialises and reduces its gradients
across devices must be compiled with :func:`compiler_options`: XLA's
latency-hiding scheduler, which a GPU program with collectives goes through,
moves the recomputed forward passes early to overlap them with the gradients'
collectives, and so keeps their activations alive at once. Measured on two
H100s (``bench/probes/mesh_remat_probe.py``): the GPT 1.3B's accumulated
gradient step with ``"full"`` needs 10.66 GiB on one GPU and 33.64 GiB a GPU
on ``data=2`` (``"none"``: 39.19); the same program has as many matmuls (no
recomputation merged away), and with the scheduler off, or with no collective
in the program, it needs 10.66 GiB again. CPUs have no such scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_dos.memory import kinds as memory

# The matmul outputs a model tags (jax.ad_checkpoint.checkpoint_name) for the "minimal" and "offload" policies.
REMAT_NAMES = ("qkv_proj", "out_proj", "mlp_in", "mlp_out")
REMAT_POLICIES = ("full", "minimal", "none", "offload")
# The policies a planner chooses among on its own ("offload" competes with the state's streaming for the link, which
# the timeline does not price yet: a user names it).
PLANNED_POLICIES = ("full", "minimal", "none")


# XLA's GPU scheduler that overlaps a program's collectives with its computation: off, it keeps jax.checkpoint's order.
LATENCY_HIDING_SCHEDULER = "xla_gpu_enable_latency_hiding_scheduler"


def compiler_options(sharding: Any) -> dict[str, Any]:
  """XLA options under which a gradient program laid out by ``sharding`` keeps its rematerialisation.

  ``sharding``: the ``jax.sharding.Sharding`` of the program's batch (or
  ``None``). On GPUs, where it spans several devices, the latency-hiding
  scheduler off (the module docstring says why; the collectives then run
  where the program computes them, not under later work); ``{}`` elsewhere.
  Pass it as ``jax.jit(..., compiler_options=...)``.
  """
  devices = getattr(sharding, "device_set", None) or ()
  if len(devices) < 2 or next(iter(devices)).platform != "gpu":
    return {}
  return {LATENCY_HIDING_SCHEDULER: False}


def check_policy(name: str) -> str:
  """``name`` if it is a policy of :data:`REMAT_POLICIES`, else a ``ValueError`` saying which names exist."""
  if name not in REMAT_POLICIES:
    raise ValueError(f"unknown rematerialisation policy {name!r}; use one of {REMAT_POLICIES}.")
  return name


def checkpoint_policy(name: str) -> Callable[..., Any] | None:
  """The ``jax.checkpoint`` / ``nnx.remat`` ``policy=`` of a policy name (``None``: ``"full"``, jax's default).

  ``"none"`` gives ``everything_saveable``; :func:`rematerialise` does not wrap the function at all.
  """
  policies = jax.checkpoint_policies
  table = {
    "full": None,
    "minimal": policies.save_only_these_names(*REMAT_NAMES),
    "none": policies.everything_saveable,
    "offload": policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(), names_which_can_be_offloaded=REMAT_NAMES, offload_src="device",
      offload_dst="pinned_host",
    ),
  }  # fmt: skip
  return table[check_policy(name)]


def rematerialise(fn: Callable, name: str) -> Callable:
  """``fn`` under policy ``name``: ``jax.checkpoint(fn, policy=...)``, or ``fn`` itself for ``"none"``."""
  if check_policy(name) == "none":
    return fn
  return jax.checkpoint(fn, policy=checkpoint_policy(name))


def describe(policies: tuple[str, ...]) -> str:
  """``policies`` (one per stage) in a few words: ``"full"``, or ``"minimal on 30 of 34 stages, full on 4"``."""
  counts = {p: policies.count(p) for p in dict.fromkeys(policies)}
  if len(counts) == 1:
    return next(iter(counts))
  (first, n), *rest = sorted(counts.items(), key=lambda item: (item[0] == "full", -item[1]))
  return f"{first} on {n} of {len(policies)} stages, " + ", ".join(f"{p} on {m}" for p, m in rest)


@jax.tree_util.register_pytree_node_class
class Saved:
  """The residuals a stage's forward program keeps for its backward program under a policy other than ``"full"``
  (``jax_dos.staged.stages``).

  ``arrays`` are the leaves of the ``jax.vjp`` function that are not the
  stage's own inputs; ``treedef`` is that function's tree, and ``sources``
  says, per leaf, which input leaf of ``(params, x, batch, inputs)`` it is
  (``-1``: the next of ``arrays``). The backward program gets the inputs
  anyway, so they are neither returned nor held twice.
  """

  def __init__(self, arrays: tuple, treedef: Any, sources: tuple[int, ...]):
    self.arrays, self.treedef, self.sources = tuple(arrays), treedef, sources

  def tree_flatten(self):
    return self.arrays, (self.treedef, self.sources)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children, *aux)

  def vjp(self, params: tuple, x: Any, batch: Any, inputs: Any = None) -> Callable:
    """The stage's vjp function, its inputs put back among the saved arrays."""
    given, arrays = jax.tree.leaves((params, x, batch, inputs)), iter(self.arrays)
    return jax.tree.unflatten(self.treedef, [next(arrays) if s < 0 else given[s] for s in self.sources])

  def device_bytes(self) -> int:
    """Accelerator bytes (per device) of the saved arrays; those the policy offloaded to the host count none."""
    return sum(memory.device_elements(a) * a.dtype.itemsize for a in self.arrays if memory.memory_kind(a) == "device")
