"""Probe: what the all-gather of a block's sharded weights costs inside its stage programs (issue 50's prefetch).

On ``--mesh fsdp=N`` each stage program of the overlapped step gathers its block's weights itself (XLA inserts the
all-gather) and can overlap it with nothing before the block's first matmul; prefetching (each program gathering the
next stage's weights beside its own compute) would hide it. This probe bounds that gain before it is built: for one
GPT block of ``--preset``, on every local device as ``fsdp``, it times the stage's forward program and its backward
program (``remat full``: the forward recomputed) with the weights sharded as the training script shards them
(``train.parallel.param_shardings``) and with the same weights already gathered (replicated), the median of
``--reps`` calls each, and the all-gather of the block's weights alone. The forward and backward differences are what
a prefetch could take back a block and micro-batch (the gradients are reduce-scattered into the weights' layout
either way).

    PYTHONPATH=$PWD python bench/probes/gather_probe.py --preset gpt-13b gpt-30b --rows 8 --out $OUT/gather_probe.json

``--rows``: rows a device a micro-batch (the README's ``--batch``). Zero weights and random activations: the time of
the programs, not of a model.

Since the prefetch was built (``jax_dos.staged.gather_ahead``), a third backward row: the program as the overlapped step
runs it, given its weights whole and gathering the next block's (``backward_ahead_s``); and with ``--whole PRESET`` the
whole model's choice (``StagedModel.measure_times``) and its passes timed both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, ".")
import jax_dos  # noqa: E402
from jax_dos.staged.gather_ahead import gather_targets  # noqa: E402
from models import gpt  # noqa: E402
from train import parallel  # noqa: E402


def median_s(fn, reps: int) -> float:
  jax.block_until_ready(fn())  # compiles
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def block(preset: str, rows: int, seq: int, reps: int) -> dict:
  mesh = parallel.make_mesh({"data": 1, "fsdp": len(jax.devices())})
  cfg = gpt.get_config(preset, vocab_size=50304, block_size=seq, dtype="bfloat16", param_dtype="bfloat16")
  staged = gpt.staged(cfg)
  abstract = staged.split(gpt.abstract_params(cfg))
  st = staged.stages[1]  # the first block's stage
  groups = [jax.tree.map(lambda s: None, g) for g in abstract]
  for g in st.groups:
    groups[g] = jax.tree.map(
      lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), parallel.param_sharding(mesh, tuple(s.shape))), abstract[g]
    )
  model = jax_dos.StagedModel(staged.stages, len(abstract))
  sharded = tuple(groups[g] for g in st.groups)
  gathered = jax.device_put(sharded, NamedSharding(mesh, P()))
  rows_all = rows * mesh.size
  bsh = parallel.batch_sharding(mesh)
  key = jax.random.key(0)
  x = jax.device_put(jax.random.normal(key, (rows_all, seq, cfg.d_model), jnp.bfloat16), bsh)
  tokens = jax.device_put(jnp.zeros((rows_all, seq), jnp.int32), bsh)
  batch = (tokens, tokens)
  out: dict = dict(preset=preset, devices=mesh.size, rows=rows, seq=seq,
                   block_gib=sum(a.nbytes for a in jax.tree.leaves(sharded)) / 2**30)  # fmt: skip
  for name, params in (("sharded", sharded), ("gathered", gathered)):
    out[f"forward_{name}_s"] = median_s(lambda p=params: model.forward(1, p, x, batch)[0], reps)

    def backward(p=params):
      dy = jnp.ones_like(x)  # donated: a new one a call
      return model.backward(1, p, x, batch, dy, (None,) * len(st.groups), False)[1]

    out[f"backward_{name}_s"] = median_s(backward, reps)
  # The overlapped step's backward program with the weights gathered ahead (jax_dos.staged.gather_ahead): given its own
  # weights whole by the program before it, it gathers the next block's (here the same shapes, its own shards again).
  whole = tuple(jax.tree.leaves(gathered)[j] for j, _ in gather_targets(sharded))  # the leaves a device lacks

  def backward_ahead():
    dy = jnp.ones_like(x)
    given = whole or None  # on one device nothing is gathered
    out = model.backward(1, sharded, x, batch, dy, (None,) * len(st.groups), False, gathered=given, ahead=sharded)
    return out[1], out[4]

  out["backward_ahead_s"] = median_s(backward_ahead, reps)
  gather = jax.jit(lambda p: jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P())))
  out["gather_alone_s"] = median_s(lambda: gather(sharded), reps)
  both = out["forward_sharded_s"] + out["backward_sharded_s"]
  out["exposed_share"] = (both - out["forward_gathered_s"] - out["backward_gathered_s"]) / both
  # Of the backward program's loss to its gathers, what gathering ahead takes back (1: all of it).
  lost = out["backward_sharded_s"] - out["backward_gathered_s"]
  out["backward_taken_back"] = (out["backward_sharded_s"] - out["backward_ahead_s"]) / lost if lost > 0 else None
  print(json.dumps(out), flush=True)
  return out


def whole_model(preset: str, rows: int, seq: int) -> dict:
  """The whole model on ``fsdp`` over every local device: ``StagedModel.measure_times``' choice (a block's backward
  program timed both ways, ``StageTimes.gather_ahead``), then a pass of every stage's programs each way, timed (the
  faster of two each, after one that compiles): the forward and backward pass the overlapped step plans by."""
  mesh = parallel.make_mesh({"data": 1, "fsdp": len(jax.devices())})
  cfg = gpt.get_config(preset, vocab_size=50304, block_size=seq, dtype="bfloat16", param_dtype="bfloat16")
  staged = gpt.staged(cfg)
  zeros = lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), parallel.param_sharding(mesh, tuple(s.shape)))  # noqa: E731
  groups = [jax.tree.map(zeros, g) for g in staged.split(gpt.abstract_params(cfg))]
  bsh = parallel.batch_sharding(mesh)
  tokens = jax.device_put(jnp.zeros((rows * mesh.size, seq), jnp.int32), bsh)
  model = jax_dos.StagedModel(staged.stages, len(groups))
  times = model.measure_times(groups, (tokens, tokens))
  out: dict = dict(preset=preset, devices=mesh.size, rows=rows, seq=seq, stages=len(staged.stages),
                   chosen_ahead=times.gather_ahead, block_backward_s=times.gather_ahead_s)  # fmt: skip
  stage_params = [tuple(groups[g] for g in st.groups) for st in staged.stages]
  for ahead in (False, True):
    model._timed_pass(stage_params, (tokens, tokens), ahead)  # compiles
    fwd, bwd, _ = min((model._timed_pass(stage_params, (tokens, tokens), ahead) for _ in range(2)),
                      key=lambda p: sum(p[1]))  # the faster of two  # fmt: skip
    name = "ahead" if ahead else "own"
    out[f"forward_{name}_s"], out[f"backward_{name}_s"] = sum(fwd), sum(bwd)
  own, ahead = (out[f"forward_{n}_s"] + out[f"backward_{n}_s"] for n in ("own", "ahead"))
  out["speedup"] = own / ahead
  out["tokens_per_s_own"], out["tokens_per_s_ahead"] = (rows * mesh.size * seq / t for t in (own, ahead))
  print(json.dumps(out), flush=True)
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--preset", nargs="*", default=["gpt-13b"], help="presets whose one block to probe")
  ap.add_argument("--rows", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--whole", nargs="*", default=[], help="presets whose whole model's stage times to measure")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = [block(p, args.rows, args.seq, args.reps) for p in args.preset]
  models = [whole_model(p, args.rows, args.seq) for p in args.whole]
  result = dict(probe="gather_probe", device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows,
                models=models)  # fmt: skip
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
