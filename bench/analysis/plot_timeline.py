"""Timeline of one overlapped step from a ``bench/train_step.py`` JSON (the ``overlap`` variants' ``trace``).

    python bench/analysis/plot_timeline.py RESULT.json OUT.png [--variant overlap] [--step -1]

Rows: the accelerator (when each stage's forward and backward program finished,
from ``jax_dos.trace``'s watcher), the training thread (waits for parameters,
pacing), the host worker (kernel, sends, redone subgroups), the stream worker
(dispatch, waits for a free slot) and the decider (reading the clip
decision). The window is one step: from the end of one clip decision to the
end of the next.
"""

from __future__ import annotations

import argparse
import json

COLORS = {
  "forward": "#4c72b0",
  "backward": "#dd8452",
  "host.kernel": "#55a868",
  "host.send": "#8172b3",
  "host.assign": "#64b5cd",
  "host.redo": "#c44e52",
  "host.wait_grads": "#cccccc",
  "host.wait_sent": "#bbbbbb",
  "stream.dispatch": "#937860",
  "stream.wait_slot": "#dddddd",
  "stream.prefetch": "#b8860b",
  "stream.redo_host": "#8c2d04",
  "stream.wait_decision": "#eeeeee",
  "overlap.wait_params": "#c44e52",
  "decide.read": "#000000",
  "overlap.resident": "#da8bc3",
}
ROWS = {
  "accelerator": "accelerator",
  "MainThread": "training thread",
  "jax_dos-overlap-host": "host worker",
  "jax_dos-overlap-stream": "stream worker",
  "jax_dos-overlap-decide": "decider",
}


def color(name: str) -> str | None:
  return COLORS.get(name) or COLORS.get(name.split(" ")[0])


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("result")
  p.add_argument("out")
  p.add_argument("--variant", default="overlap")
  p.add_argument("--step", type=int, default=-1, help="which step (between clip decisions), default the last")
  args = p.parse_args()
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  with open(args.result) as f:
    doc = json.load(f)
  result = next(r for r in doc["results"] if r.get("variant") == args.variant)
  spans = result["trace"]
  decisions = sorted(s["end"] for s in spans if s["name"] in ("decide.read", "overlap.decide"))
  if len(decisions) < 2:
    raise SystemExit("the trace holds fewer than two steps' decisions: time more steps.")
  ends = list(zip(decisions[:-1], decisions[1:]))
  lo, hi = ends[args.step]
  fig, ax = plt.subplots(figsize=(14, 3.6))
  for row, thread in enumerate(ROWS):
    for s in spans:
      c = color(s["name"])
      if s["thread"] != thread or c is None or s["end"] < lo or s["start"] > hi:
        continue
      start, end = max(s["start"], lo), min(s["end"], hi)
      ax.broken_barh([(start - lo, max(end - start, 1e-4))], (row - 0.4, 0.8), color=c)
  ax.set_yticks(range(len(ROWS)), list(ROWS.values()))
  ax.invert_yaxis()
  ax.set_xlabel("seconds from the previous step's clip decision")
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
  ax.legend(handles, list(COLORS), ncol=6, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28))
  norms = result.get("grad_norms") or []
  ax.set_title(f"{args.variant}: one step of {hi - lo:.2f} s (clip {result.get('clip')}, measured norms"
               f" {', '.join(f'{n:.0f}' for n in norms[-3:])})", fontsize=9)  # fmt: skip
  fig.tight_layout()
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
