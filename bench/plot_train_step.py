"""Step-time breakdown chart of a ``bench/train_step.py`` result: forward+backward and exposed update per variant.

python bench/plot_train_step.py bench/results/<run>/train_step_1p3b.json out.png
python bench/plot_train_step.py a.json b.json out.png    # the variants of several runs of one configuration
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(*paths: str) -> None:
  *srcs, png = paths
  docs = [json.load(open(src)) for src in srcs]
  doc = docs[0]
  order = ("none", "idiom", "host", "auto", "writebehind", "delay", "predict", "ahead", "hostdelay")
  rows = sorted((r for d in docs for r in d["results"] if "step_s" in r), key=lambda r: order.index(r["variant"]))
  names = [r["variant"] for r in rows]
  fb = [r["fb_s"] for r in rows]
  exposed = [r["exposed_update_s"] for r in rows]
  fig, ax = plt.subplots(figsize=(7, 3.6))
  ax.barh(names, fb, label="forward + backward (incl. gradient flush)")
  ax.barh(names, exposed, left=fb, label="exposed update")
  for i, r in enumerate(rows):
    ax.text(r["step_s"] + 0.01, i, f"{r['tokens_per_s'] / 1e3:.1f}k tok/s", va="center", fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("seconds per step")
  cfg = doc["config"]
  ax.set_title(f"{cfg['preset']}, batch {cfg['batch']} x {cfg['seq_len']}: step time", fontsize=10)
  ax.set_xlim(0, max(r["step_s"] for r in rows) * 1.3)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


if __name__ == "__main__":
  main(*sys.argv[1:])
