"""What the language models here share: dtypes, attention's implementation, the loss, and their stages.

Each model (``models/gpt.py``, ``models/llama.py``) maps ``tokens[b, t]`` to
float32 ``logits[b, t, vocab]`` through ``model.embed(tokens)``, its
``model.blocks`` (an ``nnx.List``) and ``model.logits(x)``; :func:`loss` and
:func:`staged` use only that.

A batch is ``(x, y)``, or of packed rows (``train.data.pack``) ``(x, y,
segments, positions)``: then ``model(x, segments, positions)``,
``model.embed(x, positions)`` and each ``block(x, segments, positions)``
attend within a segment only (:func:`attention`) and place each token at its
position in its row.
"""

from __future__ import annotations

import dataclasses
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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None = None) -> jax.Array:
  """Causal ``jax.nn.dot_product_attention`` of ``q[b, t, h, hd]`` (:func:`attention_impl`); with ``segments[b, t]``
  (int32 ids), a query attends to the keys of its own segment only, the mask ``segments[:, :, None] ==
  segments[:, None, :]`` beside the causal one."""
  mask = None if segments is None else (segments[:, None, :, None] == segments[:, None, None, :])  # [b, 1, t, t]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=attention_impl(q))


def _apply_block(block: nnx.Module, x: jax.Array, *rows: jax.Array) -> jax.Array:
  return block(x, *rows)


def run_blocks(blocks: nnx.List, x: jax.Array, remat: str, *rows: jax.Array) -> jax.Array:
  """The residual stream through ``blocks`` in order, each under the rematerialisation policy ``remat``; ``rows``:
  packed rows' ``(segments, positions)``, or nothing."""
  apply = _apply_block if remat == "none" else nnx.remat(_apply_block, policy=jax_dos.checkpoint_policy(remat))
  for block in blocks:
    x = apply(block, x, *rows)
  return x


def tree_size(tree: Any) -> int:
  """Number of elements in a tree of arrays (or ``ShapeDtypeStruct`` s)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean token cross-entropy (natural log) in float32 over the targets ``>= 0``; a negative target (a prompt's
  token, ``train.data.masked``) counts nothing and carries no gradient."""
  counted = targets >= 0
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.where(counted, targets, 0))
  return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)


def loss(graphdef: nnx.GraphDef, params: dict, batch: tuple[jax.Array, ...]) -> jax.Array:
  """Mean cross-entropy of the model ``merge(graphdef, params)`` on ``batch = (x, y)``, or packed rows' ``(x, y,
  segments, positions)``; pure.

  ``graphdef`` is hashable, so ``jax.jit(loss, static_argnums=0)`` compiles once per model shape.
  """
  x, y, *rows = batch
  return cross_entropy(nnx.merge(graphdef, params)(x, *rows), y)


def make_loss_fn(graphdef: nnx.GraphDef) -> Callable[[dict, tuple[jax.Array, jax.Array]], jax.Array]:
  """A pure ``loss_fn(params, (x, y)) -> scalar`` for ``jax.grad``/``jax.jit``: merges and runs the model."""
  return functools.partial(loss, graphdef)


def _embed(model: nnx.Module, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  return model.embed(batch[0])


def _embed_rows(model: nnx.Module, batch: tuple[jax.Array, ...]) -> jax.Array:
  return model.embed(batch[0], batch[3])


def _block_rows(layer: nnx.Module, x: jax.Array, batch: tuple[jax.Array, ...]) -> jax.Array:
  return layer(x, batch[2], batch[3])


def _head(model: nnx.Module, x: jax.Array, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
  return cross_entropy(model.logits(x), batch[1])


def staged(model: nnx.Module, block_size: int, rows: bool = False) -> jax_dos.NNXStages:
  """``model`` (abstract: ``nnx.eval_shape``) as ``jax_dos.OverlappedStep``'s stages, through its own modules.

  The embedding, one stage per block, the final norm and head with the mean
  cross-entropy: the same function as :func:`loss` (each stage's
  activations are recomputed in its backward pass, as with ``remat=True``).
  A head tied to the token embedding uses the embedding's group too. With
  ``rows``, the step's batches are packed rows' ``(x, y, segments,
  positions)``: the embedding and every block get the segments and
  positions.
  """
  if not rows:
    batch = (jax.ShapeDtypeStruct((1, block_size), jnp.int32),) * 2
    return jax_dos.nnx_stages(model, batch, embed=_embed, blocks="blocks", head=_head)
  batch = (jax.ShapeDtypeStruct((1, block_size), jnp.int32),) * 4
  return jax_dos.nnx_stages(model, batch, embed=_embed_rows, blocks="blocks", head=_head, block=_block_rows)


def abstract_by_block(model_cls: type, cfg: Any) -> dict:
  """``model_cls(cfg)``'s parameter tree as ``jax.ShapeDtypeStruct`` s (nothing allocated), in the structure
  :func:`init_by_block` returns: ``nnx.eval_shape`` of a one-block model, its block's shapes for every block (the
  blocks are alike, as there). Not the whole model traced at once: under ``nnx.eval_shape`` each draw from an
  ``nnx.Rngs`` stream reads its traced counter's ``sharding``, whose error jax words from the trace so far, so a deep
  model took time quadratic in its depth (seconds for the 13B and 30B presets on a CPU)."""
  one = nnx.eval_shape(lambda: model_cls(dataclasses.replace(cfg, n_layer=1), rngs=nnx.Rngs(0)))
  params = nnx.to_pure_dict(nnx.state(one, nnx.Param))
  block = params["blocks"][0]
  params["blocks"] = {i: jax.tree.map(lambda x: x, block) for i in range(cfg.n_layer)}
  return params


def _init_programs(model_cls: type, block_cls: type, cfg: Any, rest_out: Any, block_out: Any) -> tuple:
  """The two jitted initialisers of :func:`init_by_block`: the model without its blocks, and one block."""
  one_block = dataclasses.replace(cfg, n_layer=1)

  def rest(key):
    params = nnx.to_pure_dict(nnx.state(model_cls(one_block, rngs=nnx.Rngs(key)), nnx.Param))
    return {k: v for k, v in params.items() if k != "blocks"}

  def block(key):
    return nnx.to_pure_dict(nnx.state(block_cls(cfg, rngs=nnx.Rngs(key)), nnx.Param))

  return jax.jit(rest, out_shardings=rest_out), jax.jit(block, out_shardings=block_out)


_cached_init_programs = functools.lru_cache(maxsize=16)(_init_programs)  # one sharding (hashable): compiled once


def init_by_block(model_cls: type, block_cls: type, cfg: Any, seed: Any, shardings: Any) -> dict:
  """``model_cls(cfg)``'s parameters as a plain nested dict, made by one program for every block and one for the
  rest, so that a deep model's initialisation compiles two small programs, not one with every layer in it (a 6.7B
  GPT's: 11 s on a CPU, against 1.5 s).

  ``model_cls(cfg, rngs)`` keeps its blocks, each ``block_cls(cfg, rngs)``, in
  ``.blocks`` (an ``nnx.List``). Keys: ``k_rest, k_blocks = split(key(seed))``;
  block ``i`` draws from ``fold_in(k_blocks, i)``, the rest from a one-block
  model under ``k_rest`` (its block is not returned, and XLA drops its
  computation). ``shardings``: a tree like the parameters, or one sharding;
  each program lays its output out so (each device computes its own shards).
  """
  k_rest, k_blocks = jax.random.split(jax.random.key(seed))
  if isinstance(shardings, dict):
    rest_out = {k: v for k, v in shardings.items() if k != "blocks"}
    rest, block = _init_programs(model_cls, block_cls, cfg, rest_out, shardings["blocks"][0])
  else:
    rest, block = _cached_init_programs(model_cls, block_cls, cfg, shardings, shardings)
  params = rest(k_rest)
  params["blocks"] = {i: block(jax.random.fold_in(k_blocks, i)) for i in range(cfg.n_layer)}
  return params
