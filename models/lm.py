"""What the language models here share: dtypes, attention's implementation, the loss, and their stages.

Each model (``models/gpt.py``, ``models/llama.py``) maps ``tokens[b, t]`` to
float32 ``logits[b, t, vocab]`` through ``model.embed(tokens)``, its
``model.blocks`` (an ``nnx.List``) and ``model.logits(x)``; :func:`loss` and
:func:`staged` use only that.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jax_dos

DTYPES = ("float32", "bfloat16")


def attention_impl(q: jax.Array) -> str | None:
  """cuDNN's fused (flash) attention on a GPU in 16-bit; XLA's otherwise (jax's ``None`` means XLA)."""
  fused = jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] % 8 == 0
  return "cudnn" if fused and q.shape[-1] <= 128 else None


def _apply_block(block: nnx.Module, x: jax.Array) -> jax.Array:
  return block(x)


def run_blocks(blocks: nnx.List, x: jax.Array, remat: str) -> jax.Array:
  """The residual stream through ``blocks`` in order, each under the rematerialisation policy ``remat``."""
  apply = _apply_block if remat == "none" else nnx.remat(_apply_block, policy=jax_dos.checkpoint_policy(remat))
  for block in blocks:
    x = apply(block, x)
  return x


def tree_size(tree: Any) -> int:
  """Number of elements in a tree of arrays (or ``ShapeDtypeStruct`` s)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean token cross-entropy (natural log) in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def loss(graphdef: nnx.GraphDef, params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  """Mean cross-entropy of the model ``merge(graphdef, params)`` on ``batch = (x, y)``; pure.

  ``graphdef`` is hashable, so ``jax.jit(loss, static_argnums=0)`` compiles once per model shape.
  """
  x, y = batch
  return cross_entropy(nnx.merge(graphdef, params)(x), y)


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[dict, tuple[jax.Array, jax.Array]], jax.Array]:
  """A pure ``loss_fn(params, (x, y)) -> scalar`` for ``jax.grad``/``jax.jit``: merges and runs the model."""
  return functools.partial(loss, graphdef)


def _embed(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  return model.embed(batch[0])


def _head(model: nnx.Module, x: jax.Array, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  return cross_entropy(model.logits(x), batch[1])


def staged(model: nnx.Module, block_size: int) -> jax_dos.NNXStages:
  """``model`` (abstract: ``nnx.eval_shape``) as ``jax_dos.OverlappedStep``'s stages, through its own modules.

  The embedding, one stage per block, the final norm and head with the mean
  cross-entropy: the same function as :func:`loss` (each stage's
  activations are recomputed in its backward pass, as with ``remat=True``).
  A head tied to the token embedding uses the embedding's group too.
  """
  batch = (jax.ShapeDtypeStruct((1, block_size), jnp.int32),) * 2
  return jax_dos.nnx_stages(model, batch, embed=_embed, blocks="blocks", head=_head)
