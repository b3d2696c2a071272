"""Which weights should a delayed update hand the forward pass? optax's AdamW on the real model, four ways.

Trains the GPT (the train script's data, schedule and clip; tiny preset by default) with
``optax.adamw`` on fp32 masters and, from ``--delay-warmup`` on, hands the forward pass:

* ``none``: the current masters (no delay);
* ``plain``: the masters before the latest update (``delay=1``, ZeRO-Offload's delayed update);
* ``extrapolate``: ``2 x_t - x_{t-1}`` from the last two stale masters;
* ``next``: ``adam_math.predict_next``'s prediction, one more AdamW step with the moments held
  (``delay=1, delay_predict="moments"``).

The recursion is ``tests/reference.py``'s (through ``delay_reference.py``). Prints the mean training
loss over each 100 steps and the validation loss::

    python bench/analysis/delay_predictors.py next --lr 3e-3 --steps 600 --delay-warmup 100
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # delay_reference, beside this file

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from delay_reference import delayed_run, setup  # noqa: E402

from train import data as data_lib  # noqa: E402
from train.evaluate import validation_loss  # noqa: E402
from train.flags import parse_args  # noqa: E402
from train.optimizer import decay_mask  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("mode", choices=("none", "plain", "extrapolate", "next"))
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--delay-warmup", type=int, default=100)
  p.add_argument("--preset", default="tiny")
  a = p.parse_args()
  args = parse_args(["--offload", "host", "--lr", str(a.lr), "--steps", str(a.steps), "--preset", a.preset])
  s = setup(args)
  b1, b2, wd, eps = args.beta1, args.beta2, args.weight_decay, 1e-8
  previous = [jax.tree.map(lambda x: x.astype(jnp.float32), s.params)]  # the stale masters of the step before

  def extrapolate(t, before, adam):
    out = jax.tree.map(lambda b, q: 2 * b - q, before, previous[0])
    previous[0] = before
    return out

  def predict_next(_, x, adam):  # from the state before the step, with the step's scalars
    t, lr = int(adam.count) + 1, float(s.schedule(int(adam.count)))
    return jax.tree.map(
      lambda x, m, v, d: x - lr * ((m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps) + (wd * x if d else 0.0)),
      x, adam.mu, adam.nu, decay_mask(x),
    )  # fmt: skip

  predict = {"extrapolate": extrapolate, "next": predict_next}.get(a.mode)
  val = [
    data_lib.get_batch(s.splits.val, args.batch, args.seq_len, args.seed, i, data_lib.VAL_STREAM)
    for i in range(args.eval_batches)
  ]
  losses: list[float] = []
  run = delayed_run(args, s, delayed=a.mode != "none", warmup=a.delay_warmup, predict=predict, losses=losses)
  for t, step in zip(range(a.steps), run):
    if (t + 1) % 100 == 0:
      v = validation_loss(s.graphdef, step.params, val)
      print(a.mode, t + 1, round(float(np.mean(losses[-100:])), 4), round(v, 4), flush=True)


if __name__ == "__main__":
  main()
