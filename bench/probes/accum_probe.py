"""How much accelerator memory does one micro-batch of an accumulated step need? Compiled, not run.

The 6.7B gradient program (``gpt.loss``, per-block ``nnx.remat``), three ways:

  ``one``    one batch, gradients returned on the accelerator (no flush): the reference;
  ``sum``    a micro-batch adding its gradients to a running sum it takes donated, after the backward pass
             (``train.gradients.accumulated_grad_step``);
  ``inbwd``  the same sum, added inside the backward pass: each parameter passes through an identity whose
             ``custom_vjp`` returns ``cotangent + sum``, so each leaf's gradient is added the moment it is final.

Reports XLA's temporaries, outputs and aliased outputs per program (GiB).

    python bench/probes/accum_probe.py --out $OUT/accum_probe.json [--dump $OUT/hlo]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

GIB = 2**30
VARIANTS = ("one", "sum", "inbwd")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="gpt-6.7b")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--dump", default=None, help="directory for XLA's HLO and buffer assignments")
  p.add_argument("--out", default="accum_probe.json")
  a = p.parse_args()
  if a.dump:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={a.dump} --xla_dump_hlo_as_text"
  import jax
  import jax.numpy as jnp
  from flax import nnx

  sys.path.insert(0, ".")
  from models import gpt

  @jax.custom_vjp
  def add_to_cotangent(param, grad_sum):
    return param

  add_to_cotangent.defvjp(lambda param, grad_sum: (param, grad_sum), lambda grad_sum, ct: (ct + grad_sum, None))

  dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
  cfg = gpt.get_config(a.preset, vocab_size=50304, dtype=dtype, param_dtype="bfloat16", remat=True)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  params = gpt.abstract_params(cfg)
  batch = (jax.ShapeDtypeStruct((a.batch, a.seq_len), jnp.int32),) * 2
  grad = jax.value_and_grad(gpt.loss, argnums=1)

  def one(params, batch):
    return grad(graphdef, params, batch)

  def summed(params, sums, batch):
    loss, grads = grad(graphdef, params, batch)
    return loss, jax.tree.map(jnp.add, sums, grads)

  def in_backward(params, sums, batch):
    loss_of = lambda p: gpt.loss(graphdef, jax.tree.map(add_to_cotangent, p, sums), batch)  # noqa: E731
    return jax.value_and_grad(loss_of)(params)

  programs = {
    "one": (one, (params, batch), ()),
    "sum": (summed, (params, params, batch), (1,)),
    "inbwd": (in_backward, (params, params, batch), (1,)),
  }
  doc = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "command": " ".join(sys.argv), "rows": []}
  for variant in a.variants.split(","):
    fn, args, donate = programs[variant]
    t = time.perf_counter()
    m = jax.jit(fn, donate_argnums=donate).lower(*args).compile().memory_analysis()
    row = dict(variant=variant, temp_gib=m.temp_size_in_bytes / GIB, out_gib=m.output_size_in_bytes / GIB,
               alias_gib=m.alias_size_in_bytes / GIB, compile_s=time.perf_counter() - t)  # fmt: skip
    print(json.dumps(row), flush=True)
    doc["rows"].append(row)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()
