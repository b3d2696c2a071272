"""Why a mesh of GPUs lost the rematerialisation, and that the training script keeps it: the gradient step's memory.

Compiles (does not run) the training script's accumulated gradient step
(``train.gradients``: 2 micro-batches of ``--rows`` rows a device, the
running sum donated) for the GPT of ``--preset``, on one device and on a
``data=N`` mesh of every local device, under ``remat full`` and ``none``, as
``train.gradients.gradient_step_memory`` compiles it for the planner: on the
mesh, XLA's latency-hiding scheduler off (``jax_dos.remat_compiler_options``)
and the gradients reduce-scattered into the partitioned state's layout. Then,
on the mesh with ``remat full``, the same program compiled otherwise, each row
testing one explanation of the loss:

* ``scheduler_on``: the scheduler on (what the script compiled before),
  with the sum reduce-scattered, or all-reduced (``all_reduce``);
* ``scheduler_off_all_reduce``: the scheduler off, the sum all-reduced;
* ``scheduler_tight``: the scheduler on under a memory limit of 15 % of the GPU;
* ``one_full_timed``, ``mesh_full_timed``, ``mesh_full_scheduler_on_timed``:
  one GPU's program, the script's on the mesh (scheduler off) and the scheduler
  on, each also run (zero weights, random tokens; the median of 5 calls):
  what turning the scheduler off costs in time;
* ``shard_map_psum``: the per-device program (``shard_map``), its gradients
  ``psum`` -med inside it; ``shard_map_no_collective``: no collective at all.

It counts the matmuls (cuBLAS calls) in each optimised program: a
recomputation merged back into the forward pass would show as fewer matmuls
than one GPU's. With ``--collectives`` it also times a 400 MB bfloat16
all-reduce, reduce-scatter and all-gather over the devices (NCCL).

    python bench/probes/mesh_remat_probe.py --collectives --out $OUT/mesh_remat_probe.json
    python bench/probes/mesh_remat_probe.py --only one_full,mesh_full,one_full_timed,mesh_full_timed,\
      mesh_full_scheduler_on_timed --out $OUT/mesh_remat_probe.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, ".")
from models import gpt, lm  # noqa: E402
from train import gradients  # noqa: E402

GIB = 2**30


def count_ops(text: str) -> dict:
  return {
    "gemms": len(re.findall(r'custom_call_target="__cublas', text)),
    "fmha": len(re.findall(r'custom_call_target="__cudnn\$fmha', text)),
    "all_reduces": len(re.findall(r"all-reduce(-start)?\(", text)),
    "reduce_scatters": len(re.findall(r"reduce-scatter(-start)?\(", text)),
  }


def analyse(compiled, sums_bytes: int) -> dict:
  m = compiled.memory_analysis()
  need = gradients.jax_dos.StepMemory.of(compiled)
  return {
    "peak_gib": (need.peak_bytes + sums_bytes) / GIB,
    "temp_gib": m.temp_size_in_bytes / GIB,
    **count_ops(compiled.as_text()),
  }


def setup(preset: str, remat: str, rows: int, seq: int, mesh: Mesh | None):
  cfg = gpt.get_config(preset, vocab_size=50304, block_size=seq, dtype="bfloat16", param_dtype="bfloat16",
                       remat=remat)  # fmt: skip
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  abstract = gpt.abstract_params(cfg)
  if mesh is None:
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    psh, bsh, n = sh, sh, 1
  else:
    psh, bsh, n = NamedSharding(mesh, P()), NamedSharding(mesh, P("data")), mesh.size
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=psh), abstract)
  part = (jax.ShapeDtypeStruct((rows * n, seq), jnp.int32, sharding=bsh),) * 2
  sums = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  return graphdef, params, part, sums


def script_step(preset, remat, rows, seq, mesh) -> dict:
  """The training script's accumulated gradient step as ``train.gradients.gradient_step_memory`` compiles it."""
  graphdef, params, part, _ = setup(preset, remat, rows, seq, mesh)
  t = time.perf_counter()
  need = gradients.gradient_step_memory(graphdef, params, (2 * part[0].shape[0], seq), 1.0, "none", 2, part[0].sharding)
  return {"peak_gib": need.peak_bytes / GIB, "compile_s": time.perf_counter() - t}


def scheduled_step(preset, remat, rows, seq, mesh, options: dict, partitioned: bool = True, timed: bool = False):
  """That program compiled under XLA ``options`` instead of the script's (the latency-hiding scheduler on: ``{}``);
  ``timed``: also run."""
  graphdef, params, part, _ = setup(preset, remat, rows, seq, mesh)
  layout = gradients.sum_layout(params, partitioned)
  shardings = layout or tuple(p.sharding for p in jax.tree.leaves(params))
  grad_sum = jax.tree.unflatten(jax.tree.structure(params), [jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s)
                                for p, s in zip(jax.tree.leaves(params), shardings)])  # fmt: skip
  t = time.perf_counter()
  program = gradients._programs(tuple(sorted(options.items())))[1]
  compiled = program.lower(graphdef, params, grad_sum, part, 1.0, 2, layout).compile()
  sums = gradients._device_bytes(params, layout)
  row = {**analyse(compiled, sums), "compile_s": time.perf_counter() - t}
  if timed:
    row["step_s"] = time_program(compiled, params, grad_sum, part)
  return row


def time_program(compiled, params, grad_sum, part, reps: int = 5) -> float:
  """Median seconds of ``reps`` calls of the compiled accumulate step on zero weights and random tokens."""
  zeros = lambda s: jax.jit(lambda: jnp.zeros(s.shape, s.dtype), out_shardings=s.sharding)()  # noqa: E731
  params, grad_sum = jax.tree.map(zeros, params), jax.tree.map(zeros, grad_sum)
  tokens = tuple(jax.device_put(np.random.default_rng(i).integers(0, 50304, p.shape, dtype=np.int32), p.sharding)
                 for i, p in enumerate(part))  # fmt: skip
  times = []
  for _ in range(reps + 1):
    t = time.perf_counter()
    out = compiled(params, grad_sum, tokens)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
    grad_sum = out[1]
  return sorted(times[1:])[reps // 2]


def per_device_step(preset, remat, rows, seq, mesh, collective: str) -> dict:
  """The same step as a per-device program (``shard_map``), gradients reduced inside it."""
  graphdef, params, part, sums = setup(preset, remat, rows, seq, mesh)

  def local(params, grad_sum, batch):
    loss, grads = jax.value_and_grad(lm.loss, argnums=1)(graphdef, params, batch)
    if collective == "psum":
      grads = jax.lax.psum(grads, "data")
    elif collective == "pscatter":
      grads = jax.tree.map(
        lambda g: jax.lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True)
        if g.shape[0] % mesh.size == 0 else jax.lax.psum(g, "data"), grads)  # fmt: skip
    return jax.lax.pmean(loss, "data"), jax.tree.map(jnp.add, grad_sum, grads)

  def spec(g):
    return P("data") if collective == "pscatter" and g.shape[0] % mesh.size == 0 else P()

  sum_specs = jax.tree.map(spec, params) if collective == "pscatter" else jax.tree.map(lambda _: P(), params)
  if collective == "none":
    sum_specs = jax.tree.map(lambda _: P("data"), params)  # each device's own sum, stacked
  fn = jax.shard_map(local, mesh=mesh, in_specs=(P(), sum_specs if collective != "none" else P(), P("data")),
                     out_specs=(P(), sum_specs if collective != "none" else P()), check_vma=False)  # fmt: skip
  grad_sum = params
  t = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=1).lower(params, grad_sum, part).compile()
  return {**analyse(compiled, sums // (mesh.size if collective == "pscatter" else 1)),
          "compile_s": time.perf_counter() - t}  # fmt: skip


def time_collectives(mesh: Mesh, mbytes: int = 400, reps: int = 10) -> list[dict]:
  """Bus bandwidth of a bfloat16 all-reduce, reduce-scatter and all-gather of ``mbytes`` MB over the mesh (NCCL)."""
  n = mesh.size
  elems = mbytes * 10**6 // 2 // n * n
  x = jax.device_put(jnp.ones((elems,), jnp.bfloat16), NamedSharding(mesh, P()))
  xs = jax.device_put(jnp.ones((elems,), jnp.bfloat16), NamedSharding(mesh, P("data")))
  ops = {
    "all_reduce": (lambda v: jax.lax.psum(v, "data"), P(), P(), x, 2 * (n - 1) / n),
    "reduce_scatter": (lambda v: jax.lax.psum_scatter(v, "data", tiled=True), P(), P("data"), x, (n - 1) / n),
    "all_gather": (lambda v: jax.lax.all_gather(v, "data", tiled=True), P("data"), P(), xs, (n - 1) / n),
  }
  out = []
  for name, (f, i, o, arg, factor) in ops.items():
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(reps):
      t = time.perf_counter()
      jax.block_until_ready(fn(arg))
      times.append(time.perf_counter() - t)
    s = sorted(times)[reps // 2]
    out.append({"op": name, "mbytes": elems * 2 / 1e6, "median_s": s, "bus_gb_s": elems * 2 * factor / s / 1e9})
    print(json.dumps(out[-1]), flush=True)
  return out


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--preset", default="gpt-1.3b")
  p.add_argument("--rows", type=int, default=8, help="rows a device in one micro-batch")
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--out", default="mesh_remat_probe.json")
  p.add_argument("--only", default="", help="comma list of row names to run (default: all)")
  p.add_argument("--collectives", action="store_true", help="also time the gradient collectives (NCCL)")
  a = p.parse_args()
  n = jax.local_device_count()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  doc = {"device": jax.devices()[0].device_kind, "devices": n, "jax": jax.__version__, "command": " ".join(sys.argv),
         "preset": a.preset, "rows_per_device": a.rows, "seq": a.seq, "rows": []}  # fmt: skip
  off = {"xla_gpu_enable_latency_hiding_scheduler": False}
  rows = {
    "one_full": lambda: script_step(a.preset, "full", a.rows, a.seq, None),
    "one_none": lambda: script_step(a.preset, "none", a.rows, a.seq, None),
    "mesh_full": lambda: script_step(a.preset, "full", a.rows, a.seq, mesh),
    "mesh_none": lambda: script_step(a.preset, "none", a.rows, a.seq, mesh),
    "mesh_full_scheduler_on": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, mesh, {}),
    "mesh_full_scheduler_on_all_reduce": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, mesh, {}, False),
    "mesh_full_scheduler_off_all_reduce": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, mesh, off, False),
    "mesh_full_scheduler_tight": lambda: scheduled_step(
      a.preset, "full", a.rows, a.seq, mesh, {"xla_gpu_memory_limit_slop_factor": 15}),
    "one_full_timed": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, None, {}, timed=True),
    "mesh_full_timed": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, mesh, off, timed=True),
    "mesh_full_scheduler_on_timed": lambda: scheduled_step(a.preset, "full", a.rows, a.seq, mesh, {}, timed=True),
    "shard_map_psum": lambda: per_device_step(a.preset, "full", a.rows, a.seq, mesh, "psum"),
    "shard_map_no_collective": lambda: per_device_step(a.preset, "full", a.rows, a.seq, mesh, "none"),
  }  # fmt: skip
  only = [r for r in a.only.split(",") if r] or list(rows)
  for name in only:
    try:
      row = {"name": name, **rows[name]()}
    except Exception as e:  # a variant that does not compile is a finding too
      row = {"name": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(json.dumps(row), flush=True)
    doc["rows"].append(row)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  print(f"\n{'program':36s} {'peak GiB':>9s} {'temp GiB':>9s} {'gemms':>6s} {'AR':>6s} {'RS':>6s} {'step s':>7s}")
  for r in doc["rows"]:
    if "error" in r:
      print(f"{r['name']:36s} {r['error'][:80]}")
    else:
      cols = [f"{r[k]:9.2f}" if k in r else f"{'':9s}" for k in ("peak_gib", "temp_gib")]
      cols += [f"{r[k]:6d}" if k in r else f"{'':6s}" for k in ("gemms", "all_reduces", "reduce_scatters")]
      cols.append(f"{r['step_s']:7.3f}" if "step_s" in r else "")
      print(f"{r['name']:36s} " + " ".join(cols))


if __name__ == "__main__":
  main()
