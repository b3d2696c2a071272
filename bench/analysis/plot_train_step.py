"""Step-time breakdown chart of a ``bench/train_step.py`` result: forward+backward and exposed update per variant.

python bench/analysis/plot_train_step.py bench/results/<run>/train_step_1p3b.json out.png
python bench/analysis/plot_train_step.py a.json b.json out.png    # the variants of several runs of one model
                                                         # (labelled by micro-batches where those differ)
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
  accum = lambda d: d["config"].get("grad_accum", 1)  # noqa: E731  (older results have no accumulation)
  rows = sorted(
    ({**r, "grad_accum": accum(d)} for d in docs for r in d["results"] if "step_s" in r),
    key=lambda r: (r["grad_accum"], order.index(r["variant"])),
  )
  several = len({r["grad_accum"] for r in rows}) > 1
  names = [f"{r['variant']} ({r['grad_accum']} x {doc['config']['batch']})" if several else r["variant"] for r in rows]
  fb = [r["fb_s"] for r in rows]
  exposed = [r["exposed_update_s"] for r in rows]
  fig, ax = plt.subplots(figsize=(7, 1.6 + 0.4 * len(rows)))
  ax.barh(names, fb, label="forward + backward (incl. gradient flush)")
  ax.barh(names, exposed, left=fb, label="exposed update")
  for i, r in enumerate(rows):
    ax.text(r["step_s"] + 0.01, i, f"{r['tokens_per_s'] / 1e3:.1f}k tok/s", va="center", fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("seconds per step")
  cfg = doc["config"]
  shape = f"{cfg['batch']} x {cfg['seq_len']}"
  title = f"step time, (k x {shape}) tokens a step" if several or accum(doc) > 1 else f"batch {shape}: step time"
  ax.set_title(f"{cfg['preset']}, {title}", fontsize=10)
  ax.set_xlim(0, max(r["step_s"] for r in rows) * 1.3)
  ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
  fig.tight_layout()
  fig.savefig(png, dpi=120)


if __name__ == "__main__":
  main(*sys.argv[1:])
