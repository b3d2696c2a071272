"""Benchmark of the optimizer update phase: jax_dos against the baselines, side by side.

One process, one GPT-like fp32 parameter tree per size (~1 B and ~4 B
parameters), resident budgets of 0 / 25 / 50 % of the Adam state (12 B per
parameter). Per size:

  (a) ``optax``     optax.adamw with all state on the accelerator (jitted, donated), where it fits;
  (d) ``torch``     torch fused CPU AdamW (``torch._fused_adamw_``) on same-size host buffers, same threads;
and per resident budget (resident subgroups filled first-fit, the rest as named):
  (b) ``traced``    the JAX idiom: state in ``pinned_host``, moved to the accelerator and back inside one
                    jit (``jax.jit(tx.update, donate_argnums=1)`` with the rest "stream");
  (c) ``host``      the rest on the host kernel (eager engine);
      ``stream``    the rest streamed by the eager engine (checks the model's stream rate);
  (e) ``auto``      the performance model's plan with this budget (eager engine);
  (f) ``floor``     host-memory floor: 32 B per non-resident parameter (state read + write 24,
                    gradient in 4, update out 4) over the host DRAM bandwidth measured here
                    (multi-threaded numpy copy/add). Streaming needs only the 24 B of state
                    (``floor_stream_s`` in the JSON).

Each timing: 1 warm-up, median of 3. Rates are parameters (all of them) per second. Results go
to ``$OUT/update_phase.json`` (default ``bench/results/``) and a table is printed.

Usage::

    python bench/update_phase.py                 # 1b and 4b on the GPU machine (~8 min)
    python bench/update_phase.py --sizes 1b      # one size
    python bench/update_phase.py --smoke         # tiny, CPU is fine; skips torch if absent
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (sets nothing until setup_env is called)

# name -> (d_model, layers, vocab, block)
SIZES = {
  "smoke": (64, 2, 512, 128),
  "smoke2": (96, 3, 512, 128),
  "1b": (2048, 20, 50304, 1024),  # 1.11 B
  "4b": (3072, 32, 50304, 1024),  # 3.78 B
}
STATE_B = 12  # fp32 master, mu, nu per parameter
FLOOR_B = 32  # host DRAM bytes per non-resident parameter: state r+w 24, grad in 4, update out 4
FLOOR_STREAM_B = 24


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--sizes", default=None, help="comma list of " + ", ".join(SIZES) + " (default 1b,4b; smoke: smoke,smoke2)"
  )
  p.add_argument("--budgets", default="0,0.25,0.5", help="resident budgets as fractions of the Adam state")
  p.add_argument("--subgroup-size", type=int, default=None, help="elements per subgroup (default 64 Mi; smoke 4096)")
  p.add_argument("--staging-gib", type=float, default=8.0, help="staging budget for streamed subgroups (GiB)")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--skip", default="", help="comma list of variants to skip: optax,torch,traced,host,stream,auto")
  p.add_argument("--recalibrate", action="store_true", help="measure the calibration again (else the cache)")
  p.add_argument("--calibration-size", type=int, default=None,
                 help="parameters per path to calibrate with (default: jax_dos's); implies --recalibrate")  # fmt: skip
  p.add_argument("--moments", choices=("float32", "bfloat16", "int8"), default="float32",
                 help="how the jax_dos variants store mu and nu (interleaved_adam(moments=...))")  # fmt: skip
  p.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU")
  p.add_argument("--trace", action="store_true", help="one more step per engine variant with jax_dos.trace spans")
  p.add_argument(
    "--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
  )
  args = p.parse_args(argv)
  args.sizes = (args.sizes or ("smoke,smoke2" if args.smoke else "1b,4b")).split(",")
  for s in args.sizes:
    if s not in SIZES:
      p.error(f"unknown size {s!r}; choose from {list(SIZES)}")
  args.budgets = [float(x) for x in args.budgets.split(",")]
  args.skip = set(filter(None, args.skip.split(",")))
  args.subgroup_size = args.subgroup_size or (4096 if args.smoke else 64 * 2**20)
  return args


def gpt_shapes(d: int, layers: int, vocab: int, block: int) -> dict:
  """Leaf shapes of a GPT-2-style model (no biases): embeddings, per-layer attention and MLP, norms."""
  layer = {
    "ln1": (d,),
    "attn_qkv": (d, 3 * d),
    "attn_proj": (d, d),
    "ln2": (d,),
    "mlp_fc": (d, 4 * d),
    "mlp_proj": (4 * d, d),
  }
  tree = {"wte": (vocab, d), "wpe": (block, d), "ln_f": (d,)}
  tree.update({f"h{i:02d}": dict(layer) for i in range(layers)})
  return tree


_DONATION_PROBE = """
import jax, jax.numpy as jnp, jax_dos
params = {"a": jnp.ones((64,)), "b": jnp.ones((8, 8))}
tx = jax_dos.interleaved_adam(1e-3, subgroup_size=64, plan="stream")
state, f = tx.init(params), jax.jit(tx.update, donate_argnums=1)
for _ in range(2):
  u, state = f(params, state, params)
jax.block_until_ready(state)
"""


def donation_works() -> bool:
  """Whether donating ``pinned_host`` state to a jit survives (jax 0.10 on CPU aborts the process)."""
  import subprocess

  proc = subprocess.run([sys.executable, "-c", _DONATION_PROBE], capture_output=True, timeout=300)
  return proc.returncode == 0


class Bench:
  """One benchmark run: the shared context, and one method per measurement (no closures over loop state)."""

  def __init__(self, args, env):
    import jax

    import jax_dos
    from jax_dos.kernels import host_kernels  # the kernel's thread count, shared with torch's here

    self.args, self.env, self.jax = args, env, jax
    self.threads = host_kernels.set_num_threads()
    try:
      import torch

      torch.set_num_threads(self.threads)
    except ImportError:
      torch = None
    self.torch = torch
    self.dev = jax.devices()[0]
    print(
      f"device {self.dev.device_kind} ({self.dev.platform}), jax {jax.__version__}, {self.threads} threads", flush=True
    )
    self.dram = common.dram_bandwidth(2**22 if args.smoke else 2**28, self.threads)
    self.bw = self.dram["bandwidth_Bps"]
    print(f"host DRAM: copy {self.dram['copy_Bps'] / 1e9:.1f} GB/s, add {self.dram['add_Bps'] / 1e9:.1f} GB/s")
    if args.calibration_size:
      self.cal = jax_dos.calibrate(size=args.calibration_size, force=True, cache=False)
    else:
      self.cal = jax_dos.calibrate(force=args.recalibrate)
    print(f"calibration: {self.cal.summary()}", flush=True)
    self.staging = int(args.staging_gib * 2**30)
    self.donate = "traced" not in args.skip and donation_works()
    if not self.donate:
      print("traced: donating pinned_host state aborts on this backend; the traced variant runs without donation")
    self.state = None

  def meta(self) -> dict:
    import numba

    a = self.args
    return {
        "device": self.dev.device_kind, "platform": self.dev.platform, "jax": self.jax.__version__,
        "host": socket.gethostname(), "python": platform.python_version(), "threads": self.threads,
        "numba_threads": numba.get_num_threads(), "torch": getattr(self.torch, "__version__", None),
        "env": self.env, "subgroup_size": a.subgroup_size, "staging_budget_bytes": self.staging, "reps": a.reps,
        "smoke": a.smoke, "traced_donates_state": self.donate, "moments": a.moments,
    }  # fmt: skip

  def block(self, x) -> None:
    self.jax.block_until_ready(x)

  def make_tree(self, flat, treedef, seed: int, scale: float):
    import jax.numpy as jnp

    jax = self.jax
    make = jax.jit(lambda k, s: scale * jax.random.normal(k, s, jnp.float32), static_argnums=1)
    keys = jax.random.split(jax.random.key(seed), len(flat))
    tree = jax.tree.unflatten(treedef, [make(k, s) for k, s in zip(keys, flat, strict=True)])
    self.block(tree)
    return tree

  def torch_adamw(self, n: int) -> dict:
    """(d) torch fused CPU AdamW on four host buffers of ``n`` fp32 (made and freed here)."""
    torch = self.torch
    p, g, m, v = (torch.full((n,), x, dtype=torch.float32) for x in (1.0, 1e-3, 0.0, 0.0))
    step = torch.tensor(1.0)
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False)
    r = common.timed(lambda: torch._fused_adamw_([p], [g], [m], [v], [], [step], **kw), reps=self.args.reps)
    print(f"  torch fused CPU AdamW: {r['time_s']:.3f} s", flush=True)
    return {**r, "rate": n / r["time_s"]}

  def optax_adamw(self, params, grads, n: int) -> tuple[dict, object]:
    """(a) optax.adamw, state on the accelerator; takes (donates) ``params``, returns the new ones."""
    import optax

    jax, ref = self.jax, optax.adamw(1e-3, weight_decay=0.01)

    def opt_step(params, state, grads):
      u, state = ref.update(grads, state, params)
      return optax.apply_updates(params, u), state

    opt_step = jax.jit(opt_step, donate_argnums=(0, 1))
    held = {"p": params}
    try:
      held["s"] = ref.init(params)

      def run():
        held["p"], held["s"] = opt_step(held["p"], held["s"], grads)
        self.block(held)

      r = common.timed(run, reps=self.args.reps)
      out = {**r, "rate": n / r["time_s"]}  # optax's own kernel: the model predicts jax_dos plans only
      print(f"  optax.adamw on device: {r['time_s']:.4f} s", flush=True)
    except Exception as e:  # out of accelerator memory, typically
      out = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      print(f"  optax.adamw on device: failed ({type(e).__name__})", flush=True)
    return out, held["p"]

  def place(self, plan) -> None:
    """Moves the state's leaves into the plan's memory kinds (untimed; the engine would in its warm-up).

    Done here with ``device_put`` because arrays that come out of the traced path carry a host memory
    space in their type, which ``jax_dos.memory.kinds.copy_in`` (used by the engine) cannot yet move to the device.
    """
    jax = self.jax
    kinds = plan.leaf_memory_kinds()

    def move(tree):
      leaves, tdef = jax.tree.flatten(tree)
      moved = [
        x if x.sharding.memory_kind == k else jax.device_put(x, x.sharding.with_memory_kind(k), may_alias=False)
        for x, k in zip(leaves, kinds, strict=True)
      ]
      return jax.tree.unflatten(tdef, moved)

    s = self.state
    self.state = s._replace(master=move(s.master), mu=move(s.mu), nu=move(s.nu))

  def variant(self, name: str, plan, params, grads, n: int, predicted) -> dict:
    """Times one jax_dos variant (eager engine, or the traced idiom for ``"traced"``)."""
    import jax_dos

    jax = self.jax
    tx = jax_dos.interleaved_adam(
      1e-3, weight_decay=0.01, subgroup_size=self.args.subgroup_size, plan=plan, moments=self.args.moments
    )
    self.place(plan)
    update = tx.update
    if name == "traced":
      update = jax.jit(tx.update, donate_argnums=1) if self.donate else jax.jit(tx.update)

    def run():
      u, self.state = update(grads, self.state, params)
      self.block((u, self.state))

    try:
      r = common.timed(run, reps=self.args.reps)
    except Exception as e:
      print(f"     {name:>6}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
      if any(x.is_deleted() for x in jax.tree.leaves(self.state)):
        self.state = None  # the caller makes a fresh one
      return {"error": f"{type(e).__name__}: {str(e)[:300]}", "predicted_s": predicted}
    ptxt = f", predicted {predicted:.4f} s" if predicted is not None else ""
    print(f"     {name:>6}: {r['time_s']:.4f} s ({n / r['time_s'] / 1e9:.2f} G/s){ptxt}", flush=True)
    out = {**r, "rate": n / r["time_s"], "predicted_s": predicted}
    if self.args.trace and name != "traced":
      with jax_dos.trace.recording() as spans:
        run()
      out["trace"] = jax_dos.trace.totals(spans)
      print("       " + ", ".join(f"{k} {v['seconds'] * 1e3:.0f} ms" for k, v in out["trace"].items()), flush=True)
    return out

  def budget(self, frac: float, params, grads, n: int) -> dict:
    """All jax_dos variants at one resident budget (a fraction of the 12 B/param state)."""
    import jax_dos
    from jax_dos.planning import cost_model, planner, search

    args, cal = self.args, self.cal
    subgroups, sizes = jax_dos.partition_leaves(params, args.subgroup_size)
    budget = int(frac * STATE_B * n)
    device = search.fill_resident(sizes, budget)
    rest = [i for i in range(len(sizes)) if i not in device]
    n_dev = sum(sizes[i] for i in device)
    n_off, k_rest = n - n_dev, len(rest)  # the model's fixed costs are per subgroup
    floor = FLOOR_B * n_off / self.bw
    out = {
        "fraction": frac, "resident_budget_bytes": budget, "resident_params": n_dev, "offloaded_params": n_off,
        "floor_s": floor, "floor_stream_s": FLOOR_STREAM_B * n_off / self.bw, "variants": {},
    }  # fmt: skip
    print(f"  -- resident budget {frac:.0%}: {n_dev / n:.1%} of params resident", flush=True)
    slots = search.stream_slots_for(rest, sizes, self.staging)
    explicit = {
      kind: jax_dos.Plan(subgroups, tuple("device" if i in device else kind for i in range(len(sizes))), sizes, slots)
      for kind in ("host", "stream")
    }
    auto = planner.make_plan(
      params, args.subgroup_size, cal, resident_budget_bytes=budget, staging_budget_bytes=self.staging
    )
    out["auto_plan"] = {
      "placements": {p: auto.elements(p) for p in ("device", "stream", "host")},
      "stream_slots": auto.stream_slots,
      "describe": auto.describe(),
    }
    plans = {"host": explicit["host"], "stream": explicit["stream"], "auto": auto, "traced": explicit["stream"]}
    for name in ("host", "stream", "auto", "traced"):
      if name in args.skip:
        continue
      plan = plans[name]
      if name == "traced":
        pred = None
      elif name == "auto":
        pred = plan.predicted["total"]
      else:
        kw = {f"n_{name}": n_off, f"k_{name}": k_rest}
        pred = cost_model.predict(cal, n_device=n_dev, stream_slots=plan.stream_slots, **kw)["total"]
      if self.state is None:
        gc.collect()
        init_tx = jax_dos.interleaved_adam(
          1e-3, weight_decay=0.01, subgroup_size=args.subgroup_size, plan="host", moments=args.moments
        )
        try:
          self.state = init_tx.init(params)
          self.block(self.state)
        except Exception as e:  # recorded like any variant's failure
          out["variants"][name] = {"error": f"init: {type(e).__name__}: {str(e)[:300]}"}
          self.state = None
          continue
      out["variants"][name] = self.variant(name, plan, params, grads, n, pred)
    print(f"     floor : {floor:.4f} s (32 B/param over {self.bw / 1e9:.1f} GB/s)", flush=True)
    return out

  def size(self, size_name: str) -> dict:
    """Everything for one model size; frees its arrays before returning."""
    args, jax = self.args, self.jax
    shapes = gpt_shapes(*SIZES[size_name])
    is_shape = lambda x: isinstance(x, tuple) and all(isinstance(i, int) for i in x)  # noqa: E731
    flat, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    n = sum(math.prod(s) for s in flat)
    print(f"\n== {size_name}: {n / 1e9:.3f} B params, {len(flat)} leaves", flush=True)
    entry = {"size": size_name, "params": n, "leaves": len(flat), "variants": {}, "budgets": []}
    if "torch" not in args.skip and self.torch is not None:  # before jax's host state exists
      entry["variants"]["torch"] = self.torch_adamw(n)
      gc.collect()
    params = self.make_tree(flat, treedef, 0, 0.02)
    grads = self.make_tree(flat, treedef, 1, 1e-3)
    if "optax" not in args.skip:
      entry["variants"]["optax"], params = self.optax_adamw(params, grads, n)
      gc.collect()
      if any(x.is_deleted() for x in jax.tree.leaves(params)):
        params = self.make_tree(flat, treedef, 0, 0.02)
    for frac in args.budgets:
      entry["budgets"].append(self.budget(frac, params, grads, n))
    self.state = None
    gc.collect()
    return entry


def main(argv=None) -> dict:
  args = parse_args(argv)
  env = common.setup_env()  # before jax starts
  t_start = time.perf_counter()
  bench = Bench(args, env)
  results = {"meta": bench.meta(), "dram": bench.dram, "calibration": bench.cal.to_dict(), "sizes": []}
  for size_name in args.sizes:
    results["sizes"].append(bench.size(size_name))
  results["elapsed_s"] = time.perf_counter() - t_start
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "update_phase.json")
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  print("\n" + table(results))
  print(f"\nwrote {path} ({results['elapsed_s']:.0f} s)")
  return results


def _num(x, spec: str) -> str:
  width = spec.split(".")[0]
  return format(x, spec) if isinstance(x, (int, float)) and x == x else format("-", f">{width}")


def _ratio(a, c) -> str:
  return f"{a / c:6.2f}" if a and c else f"{'-':>6}"


def table(results: dict) -> str:
  """Compact table: per size and budget, time, G params/s, prediction, and ratios.

  ``b/x`` = traced time / this time; ``c/x`` = time of (c), every subgroup on
  the host kernel with nothing resident (ZeRO-Offload's way, the 0% ``host``
  row) / this time (speed-ups, higher is better); ``x/f`` = this time / the
  host-memory floor. At a resident budget above 0 the ``host`` row keeps the
  resident share on the device (``res+host``).
  """
  head = (
    f"{'size':>6} {'res':>4} {'variant':>8} {'time s':>9} {'G/s':>7} {'pred s':>9} {'b/x':>6} {'c/x':>6} {'x/f':>6}"
  )
  lines = [head, "-" * len(head)]

  def row(size, res, name, r, n, ratios=""):
    t = r.get("time_s")
    text = f"{size:>6} {res:>4} {name:>8} {_num(t, '9.4f')} {_num(n / t / 1e9 if t else None, '7.2f')}"
    text += f" {_num(r.get('predicted_s'), '9.4f')}{ratios}"
    return text + (f"  {r['error'][:50]}" if "error" in r else "")

  for e in results["sizes"]:
    for name in ("optax", "torch"):
      if name in e["variants"]:
        lines.append(row(e["size"], "", name, e["variants"][name], e["params"]))
    all_host = [b["variants"].get("host", {}).get("time_s") for b in e["budgets"] if b["fraction"] == 0]
    t_c = all_host[0] if all_host else None
    for b in e["budgets"]:
      v, res = b["variants"], f"{b['fraction']:.0%}"
      t_b = v.get("traced", {}).get("time_s")
      for name in ("traced", "host", "stream", "auto"):
        if name in v:
          t = v[name].get("time_s")
          lines.append(
            row(
              e["size"],
              res,
              "res+host" if name == "host" and b["fraction"] > 0 else name,
              v[name],
              e["params"],
              f" {_ratio(t_b, t)} {_ratio(t_c, t)} {_ratio(t, b['floor_s'])}",
            )
          )
      lines.append(row(e["size"], res, "floor", {"time_s": b["floor_s"]}, e["params"]))
  return "\n".join(lines)


if __name__ == "__main__":
  main()
