"""Why the 6.7B GPT's gradient program did not fit: activation memory under each rematerialisation scheme.

Compiles (does not run) the gradient of the GPT loss for the 6.7B shape at a
few depths and reports XLA's temporary memory, for

  ``none``   the Python loop of blocks, no remat;
  ``nnx``    ``nnx.remat`` around each block (what ``GPTConfig.remat`` did);
  ``tied``   a ``custom_vjp`` per block whose backward recomputes the block after an
             ``optimization_barrier`` that ties its inputs to the incoming cotangent,
             so the recomputation cannot be scheduled before it is needed;
  ``scan``   ``lax.scan`` over stacked block parameters with ``jax.checkpoint`` on the body.

and, per head, ``f32`` (logits from an fp32 copy of the tied embedding), ``bf16``
(bf16 operands, fp32 accumulation) and ``chunked`` (bf16 head and cross-entropy
in token chunks, each rematerialised). With ``--time`` it also times
forward+backward at 1.3B for the chosen schemes.

    python bench/probes/remat_probe.py --out $OUT/remat_probe.json [--time]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

sys.path.insert(0, ".")
from models import gpt  # noqa: E402

GIB = 2**30


def tied_remat(f):
  """``f(state, x)`` whose backward recomputes ``f`` only once the cotangent exists."""

  @jax.custom_vjp
  def g(state, x):
    return f(state, x)

  def fwd(state, x):
    return f(state, x), (state, x)

  def bwd(res, ct):
    state, x, ct = jax.lax.optimization_barrier((*res, ct))
    return jax.vjp(f, state, x)[1](ct)

  g.defvjp(fwd, bwd)
  return g


def head_loss(model, x, targets, head: str, chunk: int = 2048):
  """Mean cross-entropy of ``ln_f(x) @ wte.T``."""
  emb = model.wte.embedding[...]
  if head == "f32":
    logits = model.ln_f(x, out_dtype=jnp.float32) @ emb.astype(jnp.float32).T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  h = model.ln_f(x, out_dtype=jnp.bfloat16)
  w = emb.astype(jnp.bfloat16)

  def ce(h, y):
    logits = jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()

  h, y = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
  if head == "bf16":
    return ce(h, y) / y.size
  n = y.size // chunk
  body = jax.checkpoint(lambda c, hy: (c + ce(*hy), None))
  total, _ = jax.lax.scan(body, jnp.float32(0), (h.reshape(n, chunk, -1), y.reshape(n, chunk)))
  return total / y.size


def make_loss(cfg, mode: str, head: str):
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)

  def loss(params, stacked, batch):
    tokens, targets = batch
    model = nnx.merge(graphdef, params)
    x = model.wte(tokens) + model.wpe(jnp.arange(tokens.shape[1]))[None]
    if mode == "scan":
      bgd, _ = nnx.split(model.blocks[0])
      body = jax.checkpoint(lambda x, st: (nnx.merge(bgd, st)(x), None))
      x, _ = jax.lax.scan(body, x, stacked)
    else:
      for block in model.blocks:
        if mode == "none":
          x = block(x)
        elif mode == "nnx":
          x = nnx.remat(lambda b, x: b(x))(block, x)
        else:
          bgd, st = nnx.split(block)
          x = tied_remat(lambda st, x, bgd=bgd: nnx.merge(bgd, st)(x))(st, x)
    return head_loss(model, x, targets, head)

  return loss


def abstract_inputs(preset: str, n_layer: int, mode: str, batch: int, seq: int):
  cfg = gpt.get_config(
    preset, n_layer=1 if mode == "scan" else n_layer, vocab_size=50304, block_size=seq, dtype="bfloat16",
    param_dtype="bfloat16",
  )  # fmt: skip
  params = gpt.abstract_params(cfg)
  stacked = None
  if mode == "scan":
    one = params["blocks"][0]
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((n_layer, *s.shape), s.dtype), one)
  b = (jax.ShapeDtypeStruct((batch, seq), jnp.int32),) * 2
  return cfg, params, stacked, b


def temp_gib(preset, n_layer, mode, head, batch, seq) -> dict:
  cfg, params, stacked, b = abstract_inputs(preset, n_layer, mode, batch, seq)
  fn = jax.jit(jax.value_and_grad(make_loss(cfg, mode, head), argnums=(0, 1)))
  t = time.perf_counter()
  m = fn.lower(params, stacked, b).compile().memory_analysis()
  row = dict(preset=preset, n_layer=n_layer, mode=mode, head=head, batch=batch, seq=seq,
             temp_gib=m.temp_size_in_bytes / GIB, args_gib=m.argument_size_in_bytes / GIB,
             out_gib=m.output_size_in_bytes / GIB, compile_s=time.perf_counter() - t)  # fmt: skip
  print(json.dumps(row), flush=True)
  return row


def grad_program_gib(batch: int, clip: str, flush: str) -> dict:
  """The benchmark's gradient program (``gpt.loss``, per-block ``nnx.remat``), with or without clip and flush."""
  import jax_dos

  cfg = gpt.get_config("gpt-6.7b", vocab_size=50304, dtype="bfloat16", param_dtype="bfloat16", remat=True)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  params = gpt.abstract_params(cfg)
  b = (jax.ShapeDtypeStruct((batch, 2048), jnp.int32),) * 2

  def loss_and_grads(params, batch):
    loss, grads = jax.value_and_grad(gpt.loss, argnums=1)(graphdef, params, batch)
    if clip == "clip":  # optax's: where(norm < max, g, g / norm * max)
      return loss, optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())[0]
    norm = optax.global_norm(grads)
    if clip == "scale":  # the same clip as one multiply by min(1, max / norm)
      scale = jnp.minimum(1.0, 1.0 / norm)
      return loss, jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
    return (loss, norm) if clip == "norm" else loss, grads  # raw gradients (and their norm)

  shardings = None
  if flush != "none":
    tx = jax_dos.interleaved_adam(1e-4, plan=flush)
    shardings = (None, jax_dos.gradient_shardings(tx, params))
    shardings = ((None, None), shardings[1]) if clip == "norm" else shardings
  t = time.perf_counter()
  m = jax.jit(loss_and_grads, out_shardings=shardings).lower(params, b).compile().memory_analysis()
  row = dict(program="bench loss_and_grads", batch=batch, clip=clip, flush=flush)
  row.update(temp_gib=m.temp_size_in_bytes / GIB, args_gib=m.argument_size_in_bytes / GIB)
  row.update(out_gib=m.output_size_in_bytes / GIB, host_out_gib=getattr(m, "host_output_size_in_bytes", 0) / GIB)
  row["compile_s"] = time.perf_counter() - t
  print(json.dumps(row), flush=True)
  return row


def fb_time(preset, mode, head, batch, seq, reps=5) -> dict:
  cfg, params, stacked, b = abstract_inputs(preset, gpt.PRESETS[preset]["n_layer"], mode, batch, seq)
  key = iter(jax.random.split(jax.random.key(0), 1000))
  real = lambda s: (0.02 * jax.random.normal(next(key), s.shape, jnp.float32)).astype(s.dtype)  # noqa: E731
  params = jax.tree.map(real, params)
  stacked = None if stacked is None else jax.tree.map(real, stacked)
  tokens = jax.random.randint(next(key), (batch, seq), 0, 50304)
  fn = jax.jit(jax.value_and_grad(make_loss(cfg, mode, head), argnums=(0, 1)))
  jax.block_until_ready(fn(params, stacked, (tokens, tokens)))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(params, stacked, (tokens, tokens)))
    times.append(time.perf_counter() - t)
  stats = jax.devices()[0].memory_stats() or {}
  row = dict(preset=preset, mode=mode, head=head, batch=batch, seq=seq, fb_s=sorted(times)[len(times) // 2],
             times=times, peak_gib=stats.get("peak_bytes_in_use", 0) / GIB)  # fmt: skip
  print(json.dumps(row), flush=True)
  return row


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="remat_probe.json")
  p.add_argument("--time", action="store_true")
  p.add_argument("--time-preset", default="gpt-1.3b")
  p.add_argument("--depths", default="4,8")
  p.add_argument("--grad-programs", default="", help="clip|scale|norm|noclip : none|host, comma list")
  p.add_argument("--modes", default="none,nnx,tied,scan")
  p.add_argument("--full", default="tied:f32,tied:bf16,tied:chunked,scan:chunked", help="mode:head at 32 layers")
  p.add_argument("--timed", default="nnx:f32,tied:bf16,tied:chunked,scan:chunked", help="mode:head at 1.3B")
  a = p.parse_args()
  doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv)}

  def save(key: str, row: dict) -> None:  # after every row: a run cut short keeps what it measured
    doc.setdefault(key, []).append(row)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)

  for spec in filter(None, a.grad_programs.split(",")):
    clip, flush = spec.split(":")
    save("grad_program", grad_program_gib(8, clip, flush))
  for depth in map(int, filter(None, a.depths.split(","))):
    for mode in a.modes.split(","):
      save("memory", temp_gib("gpt-6.7b", depth, mode, "f32", 8, 2048))
  for mh in filter(None, a.full.split(",")):
    mode, head = mh.split(":")
    save("memory", temp_gib("gpt-6.7b", 32, mode, head, 8, 2048))
  if a.time:
    for mh in filter(None, a.timed.split(",")):
      save("timing", fb_time(a.time_preset, *mh.split(":"), 8, 2048))


if __name__ == "__main__":
  main()
