"""Overlay the loss curves of several training runs and say how far apart they are.

    python bench/analysis/compare_curves.py OUT.png label=metrics.jsonl [label=metrics.jsonl ...]

Prints, per run against the first: the mean and max |difference| of the training loss over the last half of the
steps (smoothed over 10 steps), and the final validation losses. Reads the JSONL written by ``train.gpt``.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def read(path: str) -> tuple[dict[int, float], dict[int, float]]:
  train, val = {}, {}
  with open(path) as f:
    for line in f:
      row = json.loads(line)
      if "loss" in row:
        train[row["step"]] = row["loss"]
      if "val_loss" in row:
        val[row["step"]] = row["val_loss"]
  return train, val


def smooth(x: np.ndarray, k: int = 10) -> np.ndarray:
  return np.convolve(x, np.ones(k) / k, mode="valid")


def main(argv: list[str]) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out, runs = argv[0], [a.split("=", 1) for a in argv[1:]]
  data = {label: read(path) for label, path in runs}
  fig, ax = plt.subplots(figsize=(7, 4.5))
  base_label = runs[0][0]
  base = data[base_label][0]
  steps = sorted(base)
  for label, (train, val) in data.items():
    s = sorted(train)
    ax.plot(s, [train[i] for i in s], lw=1, alpha=0.8, label=f"{label} train")
    ax.plot(sorted(val), [val[i] for i in sorted(val)], "o--", label=f"{label} val")
    common = [i for i in steps if i in train]
    a, b = smooth(np.array([base[i] for i in common])), smooth(np.array([train[i] for i in common]))
    half = len(a) // 2
    diff = np.abs(a[half:] - b[half:])
    print(
      f"{label:>8}: final val {val[max(val)]:.4f}; smoothed train loss vs {base_label} over the last half: "
      f"mean |diff| {diff.mean():.4f}, max {diff.max():.4f}"
    )
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/byte)")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=120)
  print(f"wrote {out}")


if __name__ == "__main__":
  main(sys.argv[1:])
