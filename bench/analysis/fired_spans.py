"""What happened after each fired clip's decision, from ``train.gpt --profile``'s host spans (``spans.json``).

For each decision (a ``decide.read`` span) up to the next one: when each offloaded path's work after it ended
(the host kernel's ``host.kernel_after_decision`` calls, the stream path's ``stream.redo_host`` share), how many
subgroups each took, the host kernel's busy time (its ``host.kernel`` calls), and how long the training thread waited
for parameters (``overlap.wait_params``). With ``--host-params N`` (the plan's host parameters, its ``host:`` line),
the rate both paths reached together: ``N`` over the later path's end. Seconds from the decision's end; the last
decision's row runs to the record's end, which settles the step (its wait for parameters holds that)::

    python bench/analysis/fired_spans.py bench/results/fired_profile-h100/readme_fired_spans.json \\
        --host-params 3759067136 [--json out.json]
"""

from __future__ import annotations

import argparse
import json

_NAMES = ("host.kernel_after_decision", "stream.redo_host", "host.kernel", "overlap.wait_params")


def _named(spans: list[dict], name: str) -> list[dict]:
  return [s for s in spans if s["name"] == name]


def after_decisions(spans: list[dict], host_params: int | None = None) -> list[dict]:
  """One row per decision (module docstring); ``spans`` as ``spans.json`` holds them (seconds, any origin)."""
  spans = sorted(spans, key=lambda s: s["start"])
  decisions = [s for s in spans if s["name"] == "decide.read"]
  rows = []
  for k, d in enumerate(decisions):
    until = decisions[k + 1]["start"] if k + 1 < len(decisions) else float("inf")
    inside = [s for s in spans if d["end"] <= s["start"] < until]
    host, stream, kernel, waits = (_named(inside, n) for n in _NAMES)
    row = {
      "decision_end_s": d["end"],
      "next_decision_s": None if until == float("inf") else until - d["end"],
      "host_subgroups": len(host),
      "host_end_s": max((s["end"] for s in host), default=d["end"]) - d["end"],
      "host_kernel_busy_s": sum(s["end"] - s["start"] for s in kernel),
      "stream_subgroups": len(stream),
      "stream_end_s": max((s["end"] for s in stream), default=d["end"]) - d["end"],
      "wait_params_s": sum(s["end"] - s["start"] for s in waits),
    }
    if host_params:
      row["both_paths_Gps"] = host_params / max(row["host_end_s"], row["stream_end_s"], 1e-9) / 1e9
    rows.append(row)
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("spans", help="a run's profile/spans.json")
  p.add_argument("--host-params", type=int, default=None, help="the plan's host parameters (its host: line)")
  p.add_argument("--json", default=None, help="also write the rows here")
  a = p.parse_args()
  with open(a.spans) as f:
    doc = json.load(f)
  rows = after_decisions(doc["spans"], a.host_params)
  for r in rows:
    gap = "" if r["next_decision_s"] is None else f", next decision after {r['next_decision_s']:.3f} s"
    rate = f"; both paths {r['both_paths_Gps']:.2f} G params/s" if "both_paths_Gps" in r else ""
    print(f"decision at {r['decision_end_s']:.3f} s{gap}: host kernel {r['host_subgroups']} subgroups, ended"
          f" {r['host_end_s']:.3f} s after (busy {r['host_kernel_busy_s']:.3f} s); stream path {r['stream_subgroups']}"
          f" subgroups, ended {r['stream_end_s']:.3f} s after; waited for parameters {r['wait_params_s']:.3f} s"
          f"{rate}")  # fmt: skip
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
