"""Is the delayed update what it claims to be? optax's AdamW run as the one-step delayed recursion, on the real model.

Trains the GPT (tiny preset, the embedded corpus, the train script's schedule,
clip and batches) with ``optax.adamw`` on fp32 masters, and from
``--delay-warmup`` on hands the forward pass the masters *before* the latest
update (so step t+1's gradients are taken at step t-1's parameters); prints
its per-step losses next to those of a ``python -m train.gpt --delay 1`` run's
``metrics.jsonl``. Identical columns mean the engine implements the recursion
and any convergence gap belongs to the recursion itself::

    python -m train.gpt --steps 300 --offload host --delay 1 --lr 3e-4 --out /tmp/d1 --overwrite
    python bench/analysis/delay_reference.py --lr 3e-4 --steps 40 /tmp/d1/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from models import gpt as gpt_model  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import gpt as train_gpt  # noqa: E402
from train import gradients  # noqa: E402


class Reference(NamedTuple):
  """The train script's setup for parsed ``args``, with ``optax.adamw`` on fp32 masters."""

  splits: Any
  graphdef: Any
  params: Any  # in the run's parameter dtype
  schedule: Any
  masters: Any
  state: Any  # optax.adamw's
  adam_step: Any  # (masters, state, grads, scale) -> (masters, state), jitted


def reference(args) -> Reference:
  """Model, data, schedule and optimizer exactly as ``python -m train.gpt`` builds them from ``args``."""
  splits = data_lib.split(data_lib.load_tokens(None)[0])
  cfg = gpt_model.get_config(args.preset, vocab_size=256, dtype=args.compute_dtype, param_dtype=args.param_dtype)
  graphdef, params = gpt_model.init_params(cfg, seed=args.seed)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.decay_steps, args.min_lr)
  tx = optax.adamw(schedule, b1=args.beta1, b2=args.beta2, eps=1e-8, weight_decay=args.weight_decay,
                   mask=train_gpt.decay_mask)  # fmt: skip
  masters = jax.tree.map(lambda x: x.astype(jnp.float32), params)

  @jax.jit
  def adam_step(masters, state, grads, scale):
    updates, state = tx.update(jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads), state, masters)
    return optax.apply_updates(masters, updates), state

  return Reference(splits, graphdef, params, schedule, masters, tx.init(masters), adam_step)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("metrics", help="metrics.jsonl of the train.gpt run to compare with")
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--steps", type=int, default=40, help="steps to compare")
  p.add_argument("--horizon", type=int, default=300, help="the run's --steps (sets the schedule)")
  p.add_argument("--delay", type=int, default=1, choices=(0, 1))
  p.add_argument("--delay-warmup", type=int, default=10)
  a = p.parse_args()
  args = train_gpt.parse_args(["--offload", "host", "--lr", str(a.lr), "--steps", str(a.horizon)])
  splits, graphdef, params, _, masters, state, adam_step = reference(args)
  losses = []
  for t in range(a.steps):
    batch = data_lib.get_batch(splits.train, args.batch, args.seq_len, args.seed, t)
    loss, grads, scale = gradients.make_grad_step(None, params)(graphdef, params, batch, args.clip)
    losses.append(float(loss))
    before = masters
    masters, state = adam_step(masters, state, grads, scale)
    forward = before if (a.delay and t >= a.delay_warmup) else masters
    params = jax.tree.map(lambda m, x: m.astype(x.dtype), forward, params)
  with open(a.metrics) as f:
    run = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
  worst = max(abs(x - run[t + 1]) for t, x in enumerate(losses))
  print("reference", [round(x, 4) for x in losses])
  print("jax_dos  ", [round(run[t + 1], 4) for t in range(a.steps)])
  print(f"largest difference over {a.steps} steps: {worst:.2e}")


if __name__ == "__main__":
  main()
