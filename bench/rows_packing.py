"""Fine-tuning speed with rows as examples (``--packing rows``) against one packed token stream (``--packing stream``),
on the same prompt/completion rows, the same checkpoint and the same flags, in one process:

    PYTHONPATH=$PWD python bench/rows_packing.py --out /tmp/rows_packing [--preset tiny --seq-len 128 --steps 150]

``bench/pretrained_checkpoint.py`` writes a random-weight checkpoint of ``--preset`` (float32) with a BPE tokenizer
and rows of the built-in corpus (each top-level ``def``: its signature the prompt, its body the completion); then
``python -m train.gpt --init-from`` trains ``--steps`` steps of each packing, ``--repeats`` times, alternating.
For each run: ``tokens_per_s`` (the script's own: batch x seq_len positions a second, padding included, steps 2 to
the end), and from the training split's sequences the share of positions that hold a row's token and the share that
are counted targets (a completion's), so ``row_tokens_per_s`` and ``targets_per_s`` are the work that counts.
Writes ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrained_checkpoint  # noqa: E402

from train import data as D  # noqa: E402
from train import gpt as T  # noqa: E402
from train.tokenizer import Tokenizer  # noqa: E402


def shares(rows_path: str, tokenizer: Tokenizer, packing: str, seq_len: int) -> dict[str, float]:
  """The training split's share of positions that hold a row's token, and of those that are counted targets."""
  if packing == "rows":
    train = D.pack(D.split_rows(D.load_rows(rows_path, tokenizer)[0])[0], seq_len)
    return {"row_share": train.filled / train.x.size, "target_share": float((train.y >= 0).mean()),
            "sequences": len(train), "rows_cut": train.cut}  # fmt: skip
  stream = D.split(D.load_tokens(rows_path, tokenizer=tokenizer)[0]).train
  return {"row_share": 1.0, "target_share": float((stream[1:] >= 0).mean()), "tokens": len(stream)}


def gradient_times(ckpt: str, rows_path: str, tokenizer: Tokenizer, batch: int, seq_len: int, calls: int) -> dict:
  """The jitted gradient of ``models.lm.loss`` at the checkpoint's weights on one batch of each packing, called
  ``calls`` times each, alternating: the fastest call and the median (seconds), and positions/s of the fastest."""
  from flax import nnx

  from models import hf, lm

  graphdef, params = nnx.split(hf.load(ckpt), nnx.Param)
  grad = jax.jit(jax.value_and_grad(lm.loss, argnums=1), static_argnums=0)
  stream = D.split(D.load_tokens(rows_path, tokenizer=tokenizer)[0]).train
  packed = D.pack(D.split_rows(D.load_rows(rows_path, tokenizer)[0])[0], seq_len)
  batches = {p: D.get_batch(data, batch, seq_len, 0, 0) for p, data in (("stream", stream), ("rows", packed))}
  times = {p: [] for p in batches}
  for b in batches.values():
    jax.block_until_ready(grad(graphdef, params, b))  # compiled
  for _ in range(calls):
    for p, b in batches.items():
      t = time.perf_counter()
      jax.block_until_ready(grad(graphdef, params, b))
      times[p].append(time.perf_counter() - t)
  return {p: {"fastest_s": min(t), "median_s": float(np.median(t)), "positions_per_s": batch * seq_len / min(t)}
          for p, t in times.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True)
  p.add_argument("--preset", default="tiny")
  p.add_argument("--vocab", type=int, default=2048)
  p.add_argument("--corpus-mb", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--steps", type=int, default=150)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--calls", type=int, default=40, help="the gradient's timed calls of each packing")
  p.add_argument("--gradient-only", action="store_true", help="the gradient's calls alone, no training runs")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  ckpt, rows = out / "checkpoint", str(out / "rows.jsonl")
  pretrained_checkpoint.main(["--preset", args.preset, "--out", str(ckpt), "--rows", rows, "--vocab", str(args.vocab),
                              "--model-vocab", str(args.vocab), "--corpus-mb", str(args.corpus_mb), "--dtype",
                              "float32"])  # fmt: skip
  tokenizer = Tokenizer(str(ckpt))
  flags = ["--init-from", str(ckpt), "--data", rows, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "4", "--log-every", "10", "--no-ckpt",
           "--quiet", "--param-dtype", "float32", "--lr", "1e-3", "--overwrite"]  # fmt: skip
  runs = []
  for repeat in range(0 if args.gradient_only else args.repeats):
    for packing in ("stream", "rows"):
      t0 = time.perf_counter()
      result = T.main([*flags, "--packing", packing, "--out", str(out / f"run_{packing}")])
      share = shares(rows, tokenizer, packing, args.seq_len)
      tps = result["tokens_per_s"]
      runs.append({"packing": packing, "repeat": repeat, "tokens_per_s": tps, **share,
                   "row_tokens_per_s": tps * share["row_share"], "targets_per_s": tps * share["target_share"],
                   "final_loss": result["losses"][args.steps], "val_loss": result["val_losses"][args.steps],
                   "wall_s": time.perf_counter() - t0})  # fmt: skip
      r = runs[-1]
      print(
        f"{packing:6s} #{repeat}: {tps:8.0f} positions/s, {r['row_tokens_per_s']:8.0f} row tokens/s,"
        f" {r['targets_per_s']:8.0f} targets/s; loss {r['final_loss']:.3f}, val {r['val_loss']:.3f}",
        flush=True,
      )
  keys = ("tokens_per_s", "row_tokens_per_s", "targets_per_s")
  ways = (("median", np.median), ("best", np.max)) if runs else ()
  summary = {how: {p: {k: float(f([r[k] for r in runs if r["packing"] == p])) for k in keys}
                   for p in ("stream", "rows")} for how, f in ways}  # fmt: skip
  ratio = {how: {k: summary[how]["rows"][k] / summary[how]["stream"][k] for k in keys} for how in summary}
  for how in ratio:  # the best of the repeats: the least disturbed by other work on a shared machine
    print(f"rows / stream ({how} of {args.repeats}): " + ", ".join(f"{k} {v:.3f}" for k, v in ratio[how].items()))
  grads = gradient_times(str(ckpt), rows, tokenizer, args.batch, args.seq_len, args.calls)
  ratio["gradient_fastest"] = grads["rows"]["positions_per_s"] / grads["stream"]["positions_per_s"]
  for p, g in grads.items():
    print(f"gradient {p:6s}: fastest {1e3 * g['fastest_s']:.1f} ms ({g['positions_per_s']:.0f} positions/s),"
          f" median {1e3 * g['median_s']:.1f} ms of {args.calls} calls")  # fmt: skip
  print(f"rows / stream, the gradient's fastest call: {ratio['gradient_fastest']:.3f}")
  commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
  machine = {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
             "cpus": os.cpu_count(), "commit": commit}  # fmt: skip
  results = {"args": vars(args), "machine": machine, "runs": runs, "summary": summary, "gradient": grads,
             "rows_over_stream": ratio}  # fmt: skip
  (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
