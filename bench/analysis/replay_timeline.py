"""Replays the timeline model on a measured overlapped step: predicted step times against the measured one.

From a ``bench/train_step.py`` JSON (an ``overlap`` variant run with ``--timeline``) it rebuilds the model's subgroups
(its ``--arch``) and the stages that complete them, takes the measured stage times, and prints:

* the model without the stream path's cap during the backward pass, on the placements it chooses (for runs planned
  before the cap, this should equal the run's recorded ``plan_predicted``; later runs record the capped model's own
  choice, the fourth line);
* the model with the cap (``jax_dos.planning.timeline.stream_rate_during_backward``) on those same placements;
* the placements the capped model chooses, and their predicted step;
* the measured step.

In the run's micro-batch order (``micro_batch_order``, ``"batch"`` for runs made before the orders) and within its
host budget (``host_budget_bytes``, none before). The rates are the calibration's, from the JSON's ``calibration``
line or ``--rates`` (host, stream, device, host concurrent, stream concurrent, in G parameters/s)::

    python bench/analysis/replay_timeline.py bench/results/train_step-h100/gpt6p7b_2x8_overlap_batch_order.json \\
        --rates 1.9,2.81,48.3,1.81,1.75
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax_dos  # noqa: E402
from jax_dos.planning import timeline  # noqa: E402
from train.flags import ARCHS  # noqa: E402


def parse_rates(text: str) -> list[float]:
  """Five rates in G params/s, from ``"h,s,d,hc,sc"`` or a calibration summary line."""
  if re.fullmatch(r"[\d.,\s]+", text):
    return [float(x) * 1e9 for x in text.split(",")]
  found = re.search(r"host ([\d.]+) G/s, stream ([\d.]+) G/s, device ([\d.]+) G/s, concurrent host ([\d.]+) G/s"
                    r" \+ stream ([\d.]+) G/s", text)  # fmt: skip
  if not found:
    raise SystemExit(f"error: no rates in {text!r}; pass --rates h,s,d,hc,sc (G params/s).")
  return [float(x) * 1e9 for x in found.groups()]


@functools.cache
def model_subgroups(arch_name: str, preset: str, vocab_size: int, param_dtype: str) -> tuple[timeline.Subgroup, ...]:
  """The model's subgroups and the stages that complete them, from its shapes (built once a process: a 6.7B
  model's abstract construction takes seconds)."""
  arch = ARCHS[arch_name]
  cfg = arch.get_config(preset, vocab_size=vocab_size, param_dtype=param_dtype)
  stages = arch.staged(cfg)
  groups = stages.split(arch.abstract_params(cfg))
  staged = jax_dos.StagedModel(stages.stages, len(groups))
  width = 2 if param_dtype == "bfloat16" else 4
  subgroups = []
  for g, tree in enumerate(groups):
    _, sizes = jax_dos.partition_leaves(tree, jax_dos.DEFAULT_SUBGROUP_SIZE)
    subgroups += [timeline.Subgroup(n, staged.completion[g], width) for n in sizes]
  return tuple(subgroups)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("result", help="a bench/train_step.py JSON with an overlap variant")
  p.add_argument("--variant", default="overlap")
  p.add_argument("--rates", default=None, help="h,s,d,hc,sc in G params/s (default: the JSON's calibration)")
  args = p.parse_args(argv)
  with open(args.result) as f:
    doc = json.load(f)
  run = next((r for r in doc["results"] if r.get("variant") == args.variant and "stage_times" in r), None)
  if run is None:
    raise SystemExit(f"error: no {args.variant!r} run with stage times in {args.result}.")
  rates = parse_rates(args.rates or doc.get("calibration") or "")
  config = doc["config"]
  subgroups = model_subgroups(config.get("arch", "gpt"),  # runs made before --arch ran the GPT
                              config["preset"], config["vocab_size"], config["param_dtype"])  # fmt: skip
  times = timeline.StageTimes(tuple(run["stage_times"]["forward_s"]), tuple(run["stage_times"]["backward_s"]))
  compute = times.compute_s(config["grad_accum"])
  # Runs made before the micro-batch orders ran the "batch" order and planned with no host budget.
  window = times.per_window(config["grad_accum"], run.get("micro_batch_order", "batch"))
  budget = run.get("host_budget_bytes")
  resident = run["plan_elements"]["device"]
  uncapped = timeline.Rates(*rates)
  mean_size = sum(g.size for g in subgroups) / len(subgroups)
  cap = timeline.stream_rate_during_backward(times, mean_size, run.get("run_ahead_stages", 2))
  capped = timeline.Rates(*rates, stream_backward=cap)
  chosen, before = timeline.choose_placements(window, subgroups, resident, uncapped, host_budget_bytes=budget)
  same = timeline.simulate(window, subgroups, chosen, capped, before["stream_speculation"])
  rechosen, after = timeline.choose_placements(window, subgroups, resident, capped, host_budget_bytes=budget)

  def shares(placements):
    return {k: sum(g.size for g, q in zip(subgroups, placements) if q == k) for k in ("device", "stream", "host")}

  out = {
    "measured_step_s": run["step_s"],
    "recorded_prediction_s": (run.get("plan_predicted") or {}).get("step"),
    "uncapped_step_s": compute + before["exposed_s"],
    "stream_backward_rate": cap,
    "capped_same_placements_step_s": compute + same["exposed_s"],
    "capped_choice_step_s": compute + after["exposed_s"],
    "uncapped_choice": shares(chosen),
    "capped_choice": shares(rechosen),
  }
  print(f"measured step {out['measured_step_s']:.3f} s; recorded prediction {out['recorded_prediction_s']}")
  print(f"model without the cap: {out['uncapped_step_s']:.3f} s, placements {out['uncapped_choice']}")
  print(f"stream path during the backward pass: {cap / 1e9:.2f} G params/s")
  print(f"model with the cap, same placements: {out['capped_same_placements_step_s']:.3f} s")
  print(f"model with the cap, its own choice: {out['capped_choice_step_s']:.3f} s, placements {out['capped_choice']}")
  return out


if __name__ == "__main__":
  main()
