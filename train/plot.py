"""A run's loss plot, without training: ``python -m train.plot runs/tiny`` writes ``runs/tiny/loss.png``.

Reads the run's ``metrics.jsonl`` (``python -m train.gpt``'s log; a run still
training is plotted up to its last row) and draws it as ``--plot`` does at
the end of a run. Needs matplotlib, the ``plot`` extra: ``pip install -e '.[plot]'``.
"""

from __future__ import annotations

import argparse
import os

from train import progress


def main(argv: list[str] | None = None) -> str:
  """Writes the plot of the run named in ``argv`` and returns its path; errors are ``SystemExit`` saying what to do."""
  p = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__.splitlines()[0])
  p.add_argument("run", help="a run's output folder (train.gpt --out) or its metrics.jsonl")
  p.add_argument("--out", default=None, help="the PNG to write; default: loss.png next to metrics.jsonl")
  p.add_argument("--title", default=None, help="the plot's title; default: the run folder's name")
  args = p.parse_args(argv)
  path = args.run if os.path.isfile(args.run) else os.path.join(args.run, "metrics.jsonl")
  rows = progress.read_metrics(path)
  if not any("loss" in r or "val_loss" in r for r in rows):
    raise SystemExit(f"error: {path} holds no losses to plot; give the --out folder of a python -m train.gpt run.")
  folder = os.path.dirname(os.path.abspath(path))
  png = args.out or os.path.join(folder, "loss.png")
  try:
    progress.plot_losses(rows, png, title=os.path.basename(folder) if args.title is None else args.title)
  except ModuleNotFoundError as e:
    raise SystemExit(f"error: {e}") from None
  print(f"wrote {png}")
  return png


if __name__ == "__main__":
  main()
