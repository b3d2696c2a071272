"""The fired step's bound at 6.7B, from the committed runs: what the model predicts, what bounds it, what was measured.

After a fired clip every offloaded parameter is updated after the decision ``D`` (the backward pass's end), and the
next forward pass can hide that work only stage by stage: stage ``j`` starts no earlier than ``D + W_<=j / R``
(``jax_dos.planning.fired``: ``W_<=j`` the offloaded parameters of stages ``<= j``, ``R = k h_c / h + s_c`` both paths
after the decision), nor before ``D + r + F_<j`` (the resident update ``r``, the forward pass so far). So a fired step
is at least ``compute + max(r, max_j (W_<=j / R - F_<j))``, and the accelerator's room bounds how much can be resident.

This script rebuilds the 6.7B GPT's subgroups (``bench/analysis/replay_timeline.py``'s), takes the stage times of the
committed fired benchmark (``train_step-h100/gpt6p7b_2x8_overlap_clip_fires.json``: vocab 50,304; for the README's
command, vocab 256, its head's backward program is taken as the embedding's, 4 ms) and the rates each run printed,
and prints for each run: the model before (the host at the plain engine's concurrent rate, the last host subgroups
shared), the model now on the split that ran (the last ones, sized at the kernel's rate), the split now
(``jax_dos.planning.fired.fired_share``), the plan made for a firing clip (the resident share the room holds, every
stage ``full``) and the bound (``jax_dos.planning.fired.fired_bound``), against the measured step::

    python bench/analysis/fired_bound.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replay_timeline import model_subgroups  # noqa: E402

import jax_dos  # noqa: E402
from jax_dos.planning import fired, timeline  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
FIRED_RUN = os.path.join(RESULTS, "train_step-h100", "gpt6p7b_2x8_overlap_clip_fires.json")
G = 1e9
K = 2  # micro-batches
ROOM_GIB, BOUNDARY_BYTES, SLOTS = 38.39, 4_429_185_024, 4  # the README's runs: room beside the peak, stage inputs


def rates(h, s, d, hc, sc, k, moments="float32", kernel_ratio=None) -> timeline.Rates:
  """A run's printed calibration (G params/s) scaled to ``moments`` as ``Calibration.for_moments`` does, the host path
  by ``kernel_ratio`` (the measured compact kernel's ratio; ``None``: the bytes')."""
  cal = jax_dos.Calibration(h * G, s * G, d * G, hc * G, sc * G, host_kernel_rate=k * G)
  if kernel_ratio is not None and moments != "float32":
    cal = dataclasses.replace(cal, **{f"host_kernel_rate_{moments}": k * kernel_ratio * G})
    cal = cal.for_moments(moments)
  elif moments != "float32":  # the bytes' ratio, as before the compact kernels were timed
    cal = cal.for_moments(moments)
  return timeline.Rates.of(cal.to_dict())


def last_ones(window, subs, placements, r: timeline.Rates, host_rate: float) -> dict:
  """The fired step as the share of the last host subgroups in forward order ran it, sized to end both paths
  together at ``host_rate`` and the stream path's concurrent rate."""
  order = sorted(range(len(subs)), key=lambda s: (subs[s].stage, s))
  hand_over = sorted(range(len(subs)), key=lambda s: (-subs[s].stage, s))
  host = [s for s in order if placements[s] == "host"]
  streamed = sum(g.size for g, p in zip(subs, placements) if p == "stream")
  x = (sum(subs[s].size for s in host) + streamed) * r.stream_concurrent / (host_rate + r.stream_concurrent) - streamed
  share, taken = set(), 0
  for s in reversed(host):
    if taken + subs[s].size > x:
      break
    taken, share = taken + subs[s].size, share | {s}
  backward_end = sum(window.backward)
  done, t = [0.0] * len(subs), {"host": backward_end, "stream": backward_end}
  for s in [s for s in hand_over if placements[s] == "stream"] + [s for s in order if s in share]:
    t["stream"] += subs[s].size / r.stream_concurrent
    done[s] = t["stream"]
  for s in (s for s in host if s not in share):
    t["host"] += subs[s].size / host_rate
    done[s] = t["host"]
  return timeline.next_forward(window, subs, placements, r, done, backward_end, t)


def fired_plan(window, subs, r: timeline.Rates, moments: str, cap: int) -> list[str]:
  """The placements a plan for a firing clip makes: the resident share the room holds beside the step's peak (every
  stage ``full``; at most the plain plan's ``cap``), the rest split by the fired step's predicted time."""
  state = jax_dos.state_bytes_per_param(moments)
  largest = max(g.size for g in subs)
  resident = min(cap, int((ROOM_GIB * 2**30 - BOUNDARY_BYTES - SLOTS * (state + 4) * largest) / state))
  placements, _ = timeline.choose_placements(
    window, subs, resident, r, score=lambda trial, _: fired.simulate_fired(window, subs, trial, r)["exposed_s"]
  )
  return placements


def row(name, times, subs, placements, r, measured) -> dict:
  window, compute = times.per_window(K, "stage"), times.compute_s(K)
  before = dataclasses.replace(r, host_kernel=0.0)
  out = {
    "run": name,
    "measured_s": measured,
    "compute_s": compute,
    "model_before_s": compute + last_ones(window, subs, placements, before, before.host_concurrent)["exposed_s"],
    "model_as_ran_s": compute + last_ones(window, subs, placements, r, r.host_after_decision)["exposed_s"],
    "interleaved_s": compute + fired.simulate_fired(window, subs, placements, r)["exposed_s"],
    "bound_s": compute + fired.fired_bound(window, subs, placements, r)["exposed_s"],
    "placements": {
      p: round(sum(g.size for g, q in zip(subs, placements) if q == p) / G, 2) for p in ("device", "stream", "host")
    },  # fmt: skip
  }
  print(f"{name:52s} {str(measured):>11s} {compute:6.3f} {out['model_before_s']:7.3f} {out['model_as_ran_s']:7.3f}"
        f" {out['interleaved_s']:7.3f} {out['bound_s']:7.3f}  {out['placements']}")  # fmt: skip
  return out


def main() -> list[dict]:
  with open(FIRED_RUN) as f:
    run = json.load(f)["results"][0]
  st = run["stage_times"]
  bench_times = timeline.StageTimes(tuple(st["forward_s"]), tuple(st["backward_s"]))
  readme_times = timeline.StageTimes(tuple(st["forward_s"]), (*st["backward_s"][:-1], st["backward_s"][0]))
  bench_subs, subs = model_subgroups("gpt", "gpt-6.7b", 50304, "bfloat16"), model_subgroups("gpt", "gpt-6.7b", 256,
                                                                                            "bfloat16")  # fmt: skip
  order = lambda s: sorted(range(len(s)), key=lambda i: (s[i].stage, i))  # noqa: E731
  placed = lambda s, device, stream: timeline.stage_ordered_placements(order(s), [g.size for g in s], device, stream)  # noqa: E731
  m11 = rates(2.31, 2.9, 51.8, 2.1, 1.32, 3.22)  # train_step-h100 and train_gpt-h100 on M11
  d1e = rates(3.04, 2.75, 57.5, 2.3, 1.64, 4.63)  # overlapped_step_redesign-h100
  bf_args = (2.62, 2.9, 50.3, 2.56, 1.23, 3.93)  # fired_clip_bfloat16-h100
  print(f"{'seconds a step':52s} {'measured':>11s} {'compute':>6s} {'before':>7s} {'as ran':>7s} {'split':>7s}"
        f" {'bound':>7s}")  # fmt: skip
  rows = [
    row("benchmark fired, M11 (its plan)", bench_times, bench_subs,
        placed(bench_subs, 2_245_025_792, 587_354_112), m11, "3.24-3.27"),
    row("README float32, M11 (the plan that ran, 30.3% resident)", readme_times, subs,
        placed(subs, 1_956_126_720, 738_369_536), m11, "3.28"),
    row("README float32, d1e57a2's machine (41.8% resident)", readme_times, subs,
        placed(subs, 2_694_533_120, 0), d1e, "3.21"),
    row("README float32, M11 rates, the plan for a firing clip", readme_times, subs,
        fired_plan(readme_times.per_window(K, "stage"), subs, m11, "float32", 3_432_128_512), m11, "-"),
  ]  # fmt: skip
  for label, ratio in (("bytes' 1.4x", None), ("kernel timed 1.1x", 1.1)):
    r = rates(*bf_args, "bfloat16", ratio)
    rows.append(row(f"README bfloat16, the plan that ran (2.2%), {label}", readme_times, subs,
                    placed(subs, 143_708_160, 990_113_792), r, "3.77"))  # fmt: skip
    window = readme_times.per_window(K, "stage")
    rows.append(row(f"README bfloat16, the plan for a firing clip, {label}", readme_times, subs,
                    fired_plan(window, subs, r, "bfloat16", 5_151_293_440), r, "-"))  # fmt: skip
  return rows


if __name__ == "__main__":
  main()
