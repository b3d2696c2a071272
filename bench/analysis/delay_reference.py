"""Is the delayed update what it claims to be? optax's AdamW run as the one-step delayed recursion, on the real model.

Trains the GPT (tiny preset, the embedded corpus, the train script's schedule,
clip and batches) with ``optax.adamw`` on fp32 masters, and from
``--delay-warmup`` on hands the forward pass the masters *before* the latest
update (so step t+1's gradients are taken at step t-1's parameters): the
recursion of ``tests/reference.py``. Prints its per-step losses next to those
of a ``python -m train.gpt --delay 1`` run's ``metrics.jsonl``. Identical
columns mean the engine implements the recursion and any convergence gap
belongs to the recursion itself::

    python -m train.gpt --steps 300 --offload host --delay 1 --lr 3e-4 --out /tmp/d1 --overwrite
    python bench/analysis/delay_reference.py --lr 3e-4 --steps 40 /tmp/d1/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # reference.py, as pytest finds it

import optax  # noqa: E402
from reference import Predictor, Scaled, Step, adamw_steps  # noqa: E402

from models import gpt as gpt_model  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import gradients  # noqa: E402
from train.flags import TrainConfig  # noqa: E402
from train.optimizer import decay_mask  # noqa: E402


class Setup(NamedTuple):
  """The train script's model, data, schedule and ``optax.adamw`` for its config ``args``."""

  splits: Any
  graphdef: Any
  params: Any  # in the run's parameter dtype
  schedule: Any
  tx: Any  # optax.adamw, as train.gpt's --offload none builds it


def setup(args: TrainConfig) -> Setup:
  """Model, data, schedule and optimizer exactly as ``python -m train.gpt`` builds them from ``args``."""
  splits = data_lib.split(data_lib.load_tokens(None)[0])
  cfg = gpt_model.get_config(args.preset, vocab_size=256, dtype=args.compute_dtype, param_dtype=args.param_dtype)
  graphdef, params = gpt_model.init_params(cfg, seed=args.seed)
  schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.decay_steps, args.min_lr)
  tx = optax.adamw(schedule, b1=args.beta1, b2=args.beta2, eps=1e-8, weight_decay=args.weight_decay, mask=decay_mask)
  return Setup(splits, graphdef, params, schedule, tx)


def delayed_run(
  args: TrainConfig, s: Setup, *, delayed: bool, warmup: int, predict: Predictor | None = None,
  losses: list | None = None,
) -> Iterator[Step]:  # fmt: skip
  """``tests/reference.py``'s recursion on the real model: the train script's batches, clip and gradient step.

  Each step's training loss is appended to ``losses``.
  """
  grad_step = gradients.make_grad_step(None, s.params)

  def grads_at(t: int, params: Any) -> Any:
    batch = data_lib.get_batch(s.splits.train, args.batch, args.seq_len, args.seed, t)
    loss, grads, scale, _ = grad_step(s.graphdef, params, batch, args.clip)
    if losses is not None:
      losses.append(float(loss))
    return Scaled(grads, scale)

  return adamw_steps(s.params, grads_at, tx=s.tx, delayed=delayed, warmup=warmup, predict=predict, jit=True)


def main() -> None:
  from train.flags import parse_args

  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("metrics", help="metrics.jsonl of the train.gpt run to compare with")
  p.add_argument("--lr", type=float, default=3e-4)
  p.add_argument("--steps", type=int, default=40, help="steps to compare")
  p.add_argument("--horizon", type=int, default=300, help="the run's --steps (sets the schedule)")
  p.add_argument("--delay", type=int, default=1, choices=(0, 1))
  p.add_argument("--delay-warmup", type=int, default=10)
  a = p.parse_args()
  args = parse_args(["--offload", "host", "--lr", str(a.lr), "--steps", str(a.horizon)])
  losses: list[float] = []
  run = delayed_run(args, setup(args), delayed=bool(a.delay), warmup=a.delay_warmup, losses=losses)
  for _ in zip(range(a.steps), run):
    pass
  with open(a.metrics) as f:
    metrics = {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
  worst = max(abs(x - metrics[t + 1]) for t, x in enumerate(losses))
  print("reference", [round(x, 4) for x in losses])
  print("jax_dos  ", [round(metrics[t + 1], 4) for t in range(a.steps)])
  print(f"largest difference over {a.steps} steps: {worst:.2e}")


if __name__ == "__main__":
  main()
