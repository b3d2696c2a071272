"""Does XLA free a gradient's accelerator memory once it is flushed to the host? Compiled, not run.

The 6.7B gradient program (``gpt.loss``, per-block ``nnx.remat``, returning
raw gradients and their global norm), with the gradients flushed five ways:

  ``none``      every gradient stays on the accelerator;
  ``all``       every gradient in ``pinned_host`` through ``out_shardings`` (what ``flush="all"`` does);
  ``half``      every other leaf's gradient to the host, the rest kept (a split flush, ``out_shardings``);
  ``first``     the first half of the leaves (flatten order: the first blocks) to the host, the rest kept;
  ``bwd-all``   every gradient moved to the host *inside* the backward pass: an identity with a ``custom_vjp``
                per leaf whose backward ``device_put`` s the cotangent to ``pinned_host`` (out through a host
                "sink" argument: a custom_vjp's cotangent must keep its input's memory space) and returns its
                squared norm, so the norm needs no gradient on the accelerator;
  ``bwd-half``  as ``bwd-all`` for every other leaf.

Reports XLA's temporaries and outputs per program. On the H100 (``bench/results/flush_probe-h100/``)
neither the in-backward flush nor the split saves memory: XLA keeps the gradients on the accelerator until the
program ends, and a split made it keep far more.

    python bench/probes/flush_probe.py --variants none,all,half,bwd-all,bwd-half --out $OUT/flush_probe.json
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
VARIANTS = ("none", "all", "half", "first", "bwd-all", "bwd-half")


def flushed_identity(x, sink, sq_sink, host):
  """``x``; in the backward pass its cotangent leaves through ``sink`` (moved to ``host``), its squared norm
  through ``sq_sink``."""

  @jax.custom_vjp
  def f(x, sink, sq):
    return x

  def fwd(x, sink, sq):
    return x, None

  def bwd(_, ct):
    return jnp.zeros_like(ct), jax.device_put(ct, host), jnp.sum(jnp.square(ct.astype(jnp.float32)))

  f.defvjp(fwd, bwd)
  return f(x, sink, sq_sink)


def gradient_program(graphdef, treedef, variant: str, host, device):
  """``(fn, out_shardings)``: ``fn(params, batch) -> (loss, grads, norm)`` flushing as ``variant`` says."""
  n = treedef.num_leaves
  to_host = {
    "none": [False] * n,
    "first": [i < n // 2 for i in range(n)],
  }.get(variant, [True] * n if variant.endswith("all") else [i % 2 == 0 for i in range(n)])
  shardings = jax.tree.unflatten(treedef, [host if h else device for h in to_host])

  def plain(params, batch):
    loss, grads = jax.value_and_grad(gpt.loss, argnums=1)(graphdef, params, batch)
    return loss, grads, optax.global_norm(grads)

  def in_backward(params, batch):
    leaves = jax.tree.leaves(params)
    kept = [x for x, h in zip(leaves, to_host) if not h]
    sinks = [jax.device_put(jnp.zeros(x.shape, x.dtype), host) for x, h in zip(leaves, to_host) if h]
    sq_sinks = [jnp.zeros((), jnp.float32) for _ in sinks]

    def loss_of(kept, sinks, sq_sinks):
      kept_it, sink_it = iter(kept), iter(zip(sinks, sq_sinks))
      out = [flushed_identity(x, *next(sink_it), host) if h else next(kept_it) for x, h in zip(leaves, to_host)]
      return gpt.loss(graphdef, jax.tree.unflatten(treedef, out), batch)

    loss, (g_kept, g_host, sq) = jax.value_and_grad(loss_of, argnums=(0, 1, 2))(kept, sinks, sq_sinks)
    norm_sq = sum(sq) + sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in g_kept)
    g_kept, g_host = iter(g_kept), iter(g_host)
    grads = [next(g_host) if h else next(g_kept) for h in to_host]
    return loss, jax.tree.unflatten(treedef, grads), jnp.sqrt(norm_sq)

  fn = in_backward if variant.startswith("bwd") else plain
  return fn, (None, None if variant == "none" else shardings, None)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="gpt-6.7b")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--out", default="flush_probe.json")
  a = p.parse_args()
  dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
  cfg = gpt.get_config(a.preset, vocab_size=50304, dtype=dtype, param_dtype="bfloat16", remat=True)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  params = gpt.abstract_params(cfg)
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  batch = (jax.ShapeDtypeStruct((a.batch, a.seq_len), jnp.int32),) * 2
  doc = {"device": dev.device_kind, "jax": jax.__version__, "command": " ".join(sys.argv), "rows": []}
  for variant in a.variants.split(","):
    if variant not in VARIANTS:
      p.error(f"unknown variant {variant!r}; choose from {VARIANTS}.")
    fn, out_shardings = gradient_program(graphdef, jax.tree.structure(params), variant, host, device)
    t = time.perf_counter()
    try:
      m = jax.jit(fn, out_shardings=out_shardings).lower(params, batch).compile().memory_analysis()
      row = dict(variant=variant, temp_gib=m.temp_size_in_bytes / GIB, out_gib=m.output_size_in_bytes / GIB,
                 host_out_gib=getattr(m, "host_output_size_in_bytes", 0) / GIB)  # fmt: skip
    except Exception as e:  # a variant this jax cannot compile is a result too
      row = dict(variant=variant, error=repr(e)[:2000])
    row["compile_s"] = time.perf_counter() - t
    print(json.dumps(row), flush=True)
    doc["rows"].append(row)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
