"""The fired step beside the plain one, from ``bench/fired_bound.sh``'s runs: measured, predicted and the bound.

For each moment format (``fired_<moments>`` and ``fired_<moments>_plain`` in the folder given) it prints which step
``--overlap auto`` took and why (its ``step`` line), the seconds a step each run measured (32,768 tokens over its
tokens/s, the mean of its windows after the first: the first holds the compilation and the first steps' allocations),
the calibration (with the host kernel's rate on each moment format), the overlapped plan's predictions (its step
after a fired clip and the bound on it: ``jax_dos.planning.fired``) and the plain plan's (its forward/backward, the
overlapped plan's ``compute_plain``, plus its update), how many steps the clip fired in, the measured speed-up of the
overlapped step over the plain one and the one its bound allows, and how far the measured fired step is from its
bound::

    python bench/analysis/fired_summary.py OUT
"""

from __future__ import annotations

import json
import os
import re
import sys

WINDOW_AFTER = 5  # the first window of tokens/s (steps 1-5) holds the compilation


def read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def step_seconds(metrics_path: str, tokens: int) -> float | None:
  """Seconds a step: ``tokens`` over each logged window's tokens/s, windows ending after :data:`WINDOW_AFTER`."""
  rows = [json.loads(line) for line in read(metrics_path).splitlines() if line.strip()]
  rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > WINDOW_AFTER]
  return sum(tokens / r for r in rates) / len(rates) if rates else None


def predictions(log: str) -> dict[str, float]:
  """The plan's printed predictions (``predicted: name 123.45 ms, ...``) in seconds, and the step line's."""
  out = {}
  line = re.search(r"^\s*[\d.]+\s+predicted: (.*)$", log, re.M)
  if line:
    out.update({k: float(v) / 1e3 for k, v in re.findall(r"(\w+) ([\d.]+) ms", line.group(1))})
  step = re.search(r"^\s*[\d.]+\s+step    (.*)$", log, re.M)
  if step:
    text = step.group(1)
    out["chose_overlapped"] = text.startswith("overlapped")
    for key, pattern in (("line_overlapped", r"overlapped ([\d.]+) s \("), ("line_fired", r"([\d.]+) s after a fired"),
                         ("line_bound", r"([\d.]+) s at best"), ("line_plain", r"plain ([\d.]+) s")):  # fmt: skip
      found = re.search(pattern, text)
      if found:
        out[key] = float(found.group(1))
  return out


def summary(folder: str, moments: str) -> dict:
  name = os.path.join(folder, f"fired_{moments}")
  log, plain_log = read(name + ".log"), read(name + "_plain.log")
  tokens = re.search(r"a step \d+ x \d+ = ([\d,]+) tokens", log or plain_log)
  tokens = int(tokens.group(1).replace(",", "")) if tokens else 32768
  got = predictions(log)
  fired_count = re.findall(r"clip \S+ fired in (\d+) of (\d+) steps", log + plain_log)
  plain_plan = re.search(r"predicted: device [\d.]+ ms, host [\d.]+ ms, stream [\d.]+ ms, total ([\d.]+) ms", plain_log)
  compute = got.get("compute_plain")
  plain_predicted = got.get("line_plain")
  if plain_plan and compute:  # the plain step's forward/backward as the stages measured it, plus its update
    plain_predicted = compute + float(plain_plan.group(1)) / 1e3
  out = {
    "moments": moments,
    "step_line": (re.search(r"^\s*[\d.]+\s+step    (.*)$", log, re.M) or [None, None])[1],
    "overlapped_s": step_seconds(name + "_metrics.jsonl", tokens),
    "plain_s": step_seconds(name + "_plain_metrics.jsonl", tokens),
    "predicted_fired_s": got.get("step_clip_fired", got.get("line_fired")),
    "bound_s": got.get("step_clip_fired_bound", got.get("line_bound")),
    "predicted_plain_s": plain_predicted,
    "clip_fired": [f"{a} of {b}" for a, b in fired_count],
    "chose_overlapped": got.get("chose_overlapped"),
  }
  o, p, b = out["overlapped_s"], out["plain_s"], out["bound_s"]
  out["speedup"] = p / o if o and p else None
  out["bound_speedup"] = p / b if b and p else None
  out["from_bound"] = o / b - 1 if o and b else None
  return out


def main(argv=None) -> list[dict]:
  argv = sys.argv[1:] if argv is None else argv
  folder = argv[0] if argv else "bench/results/fired_bound"
  fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
  rows = [summary(folder, m) for m in ("float32", "bfloat16")]
  calibration = re.search(r"^\s*[\d.]+\s+calibration (\(.*)$", read(os.path.join(folder, "fired_float32.log")), re.M)
  if calibration:  # the compact kernels' rates beside float32's: what the host path's rates are scaled by
    print(f"calibration {calibration.group(1)}")
  for r in rows:
    print(f"{r['moments']}: {r['step_line']}")
  print(f"{'moments':9s} {'fired s':>8s} {'pred':>6s} {'bound':>6s} {'plain s':>8s} {'pred':>6s} {'speed-up':>8s}"
        f" {'bound allows':>12s} {'from bound':>10s}  clip fired")  # fmt: skip
  for r in rows:
    print(f"{r['moments']:9s} {fmt(r['overlapped_s']):>8s} {fmt(r['predicted_fired_s'], '.2f'):>6s}"
          f" {fmt(r['bound_s'], '.2f'):>6s} {fmt(r['plain_s']):>8s} {fmt(r['predicted_plain_s'], '.2f'):>6s}"
          f" {fmt(r['speedup'], '.3f'):>8s} {fmt(r['bound_speedup'], '.3f'):>12s} {fmt(r['from_bound'], '+.1%'):>10s}"
          f"  {', '.join(r['clip_fired'])}")  # fmt: skip
  return rows


if __name__ == "__main__":
  main()
