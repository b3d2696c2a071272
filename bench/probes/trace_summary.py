"""Where a profiled step's time goes on each accelerator: a summary of a ``jax.profiler`` trace.

``python -m train.gpt ... --profile 6:8`` writes ``<out>/profile/plugins/profile/<time>/<host>.trace.json.gz``.
This reads it and prints, per device and per row of the trace (a stream, XLA's modules, XLA's ops), the time the
row is busy (the union of its events), its event count and its largest names by total time::

    python bench/probes/trace_summary.py runs/gpt-6.7b/profile [--top 12] [--json out.json]

A device's ``XLA Modules`` row names the programs (the gradient step's micro-batch, the update's calls, a
collective's own program), and its ``XLA Ops`` row the operations inside them (``all-gather``, ``reduce-scatter``,
fusions, GEMMs): enough to tell compute from collectives, updates and idle time.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re


def _union(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of ``(start, end)`` intervals."""
  total, end = 0.0, -float("inf")
  for a, b in sorted(intervals):
    if b <= end:
      continue
    total += b - max(a, end)
    end = b
  return total


def _kind(name: str) -> str:
  """A coarse kind of an XLA op from its name: collective, gemm, copy or other."""
  low = name.lower()
  for kind, pattern in (("collective", r"all-gather|all-reduce|reduce-scatter|all-to-all|collective|nccl"),
                        ("gemm", r"gemm|cublas|dot|matmul|cutlass|triton_gemm|cudnn"),
                        ("copy", r"memcpy|copy|dynamic-update-slice|transpose")):  # fmt: skip
    if re.search(pattern, low):
      return kind
  return "other"


def summarize(trace_path: str, top: int = 12) -> dict:
  """Per device (``/device:...`` processes of the trace), per row: busy seconds, events and top names."""
  data = json.load(gzip.open(trace_path))
  events = data["traceEvents"]
  process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
  thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
  rows = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and "dur" in e:
      rows[(e["pid"], e.get("tid"))].append(e)
  spans = [(e["ts"], e["ts"] + e["dur"]) for es in rows.values() for e in es]
  first, last = min(a for a, _ in spans), max(b for _, b in spans)
  out = {"trace": trace_path, "span_s": (last - first) / 1e6, "devices": {}}
  for (pid, tid), es in sorted(rows.items(), key=lambda kv: (process.get(kv[0][0], ""), thread.get(kv[0], ""))):
    pname = process.get(pid, str(pid))
    if not pname.startswith("/device:") and not pname.startswith("/host:"):
      continue
    by_name = collections.Counter()
    by_kind = collections.Counter()
    for e in es:
      by_name[e["name"]] += e["dur"]
      by_kind[_kind(e["name"])] += e["dur"]
    device_rows = out["devices"].setdefault(pname, {})
    name = thread.get((pid, tid), str(tid))
    device_rows[name if name not in device_rows else f"{name} #{tid}"] = {
      "busy_s": _union([(e["ts"], e["ts"] + e["dur"]) for e in es]) / 1e6,
      "events": len(es),
      "by_kind_s": {k: v / 1e6 for k, v in by_kind.most_common()},
      "top_s": {k[:120]: v / 1e6 for k, v in by_name.most_common(top)},
    }
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("folder", help="a --profile folder, or a trace.json.gz")
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--json", default=None, help="also write the summary here")
  p.add_argument("--host", action="store_true", help="the host's rows too (the Python threads)")
  a = p.parse_args()
  paths = [a.folder] if a.folder.endswith(".json.gz") else sorted(
    glob.glob(os.path.join(a.folder, "**", "*.trace.json.gz"), recursive=True))  # fmt: skip
  if not paths:
    raise SystemExit(f"no *.trace.json.gz under {a.folder}: run python -m train.gpt with --profile FIRST:STOP.")
  result = summarize(paths[-1], a.top)
  print(f"{result['trace']}: {result['span_s']:.3f} s traced")
  for device, rows in result["devices"].items():
    if device.startswith("/host:") and not a.host:
      continue
    print(device)
    for row, r in rows.items():
      kinds = ", ".join(f"{k} {v:.3f}" for k, v in r["by_kind_s"].items())
      print(f"  {row[:60]:60s} busy {r['busy_s']:.3f} s, {r['events']} events ({kinds})")
      for name, s in r["top_s"].items():
        print(f"      {s:8.4f} s  {name}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
