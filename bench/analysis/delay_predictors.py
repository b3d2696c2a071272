"""Which weights should a delayed update hand the forward pass? optax's AdamW on the real model, four ways.

Trains the GPT (the train script's data, schedule and clip; tiny preset by default) with
``optax.adamw`` on fp32 masters and, from ``--delay-warmup`` on, hands the forward pass:

* ``none``: the current masters (no delay);
* ``plain``: the masters before the latest update (``delay=1``, ZeRO-Offload's delayed update);
* ``extrapolate``: ``2 x_t - x_{t-1}`` from the last two stale masters;
* ``next``: ``adam_math.predict_next``'s prediction, one more AdamW step with the moments held
  (``delay=1, delay_predict=True``).

Prints the mean training loss over each 100 steps and the validation loss::

    python bench/analysis/delay_predictors.py next --lr 3e-3 --steps 600 --delay-warmup 100
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.analysis.delay_reference import reference  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import gpt as train_gpt  # noqa: E402
from train import gradients  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("mode", choices=("none", "plain", "extrapolate", "next"))
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--steps", type=int, default=600)
  p.add_argument("--delay-warmup", type=int, default=100)
  p.add_argument("--preset", default="tiny")
  a = p.parse_args()
  args = train_gpt.parse_args(["--offload", "host", "--lr", str(a.lr), "--steps", str(a.steps), "--preset", a.preset])
  splits, graphdef, params, schedule, masters, state, adam_step = reference(args)
  b1, b2, wd, eps = args.beta1, args.beta2, args.weight_decay, 1e-8

  def predict_next(x, adam):  # from the state before the step, with the step's scalars
    t, lr = int(adam.count) + 1, float(schedule(int(adam.count)))
    decay = train_gpt.decay_mask(x)
    return jax.tree.map(
      lambda x, m, v, d: x - lr * ((m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps) + (wd * x if d else 0.0)),
      x, adam.mu, adam.nu, decay,
    )  # fmt: skip

  val = [
    data_lib.get_batch(splits.val, args.batch, args.seq_len, args.seed, i, data_lib.VAL_STREAM)
    for i in range(args.eval_batches)
  ]
  grad_step = gradients.make_grad_step(None, params)
  previous, losses = masters, []
  for t in range(a.steps):
    batch = data_lib.get_batch(splits.train, args.batch, args.seq_len, args.seed, t)
    loss, grads, scale = grad_step(graphdef, params, batch, args.clip)
    losses.append(float(loss))
    before, adam_before = masters, state[0]
    masters, state = adam_step(masters, state, grads, scale)
    delayed = t >= a.delay_warmup and a.mode != "none"
    if not delayed:
      forward = masters
    elif a.mode == "plain":
      forward = before
    elif a.mode == "extrapolate":
      forward = jax.tree.map(lambda b, q: 2 * b - q, before, previous)
    else:
      forward = predict_next(before, adam_before)
    previous = before
    params = jax.tree.map(lambda m, x: m.astype(x.dtype), forward, params)
    if (t + 1) % 100 == 0:
      v = float(np.mean([float(train_gpt.eval_step(graphdef, params, b)) for b in val]))
      print(a.mode, t + 1, round(float(np.mean(losses[-100:])), 4), round(v, 4), flush=True)


if __name__ == "__main__":
  main()
