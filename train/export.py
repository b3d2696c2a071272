"""A run's weights as a Hugging Face checkpoint: ``python -m train.export RUN DIR``.

    python -m train.export runs/Qwen2.5-7B out/qwen-sft          # the newest checkpoint that verifies
    python -m train.export runs/llama-tiny out/tiny --step 200

Reads the parameters of ``RUN/ckpt`` (``jax_dos.CheckpointManager``: every
file verified first, nothing of the optimizer state read) and writes ``DIR``
as ``models.hf.save_params`` does: ``config.json``, safetensors shards in the
parameters' dtype, and the tokenizer's files of the run (its ``--tokenizer``,
by default its ``--init-from`` folder). ``transformers`` loads the folder. Only
``--arch llama`` runs (the Llama family) have a Hugging Face form here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax

import jax_dos
from models import hf, llama


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n")[0])
  p.add_argument("run", help="the run's --out folder (holding ckpt/)")
  p.add_argument("out", help="the folder to write the Hugging Face checkpoint in (created; files in it replaced)")
  p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
  p.add_argument("--tokenizer", default=None, help="copy the tokenizer's files from this folder (default: the run's)")
  return p


def export(run: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
           tokenizer: str | os.PathLike | None = None) -> Path:  # fmt: skip
  """Writes ``run``'s checkpoint ``step`` (default the newest that verifies) to ``out``; returns ``out``. Errors are
  ``SystemExit`` s naming what to change."""
  ckpt = os.path.join(run, "ckpt")
  if not os.path.isdir(ckpt):
    raise SystemExit(f"error: {ckpt}: no such folder; give a run's --out folder (python -m train.gpt --out RUN).")
  with jax_dos.CheckpointManager(ckpt) as manager:
    try:
      meta = manager.meta(step)
    except FileNotFoundError as e:
      raise SystemExit(f"error: {e}") from None
    arch = meta.get("args", {}).get("arch", "gpt")
    if arch != "llama":
      raise SystemExit(
        f"error: {run} trained --arch {arch}; a Hugging Face checkpoint is written for --arch llama runs (the Llama"
        " family: models/llama.py) only."
      )
    cfg = llama.LlamaConfig(**meta["config"])
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), llama.abstract_params(cfg))
    try:
      params, meta = manager.restore_params(step, params=template)
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: {e}") from None
  saved_args = meta.get("args", {})
  tokenizer = tokenizer or saved_args.get("tokenizer") or saved_args.get("init_from")
  if tokenizer is not None and not os.path.isdir(tokenizer):
    print(f"note: the run's tokenizer folder {tokenizer} is not here: no tokenizer files copied", file=sys.stderr)
    tokenizer = None
  path = hf.save_params(cfg, params, out, tokenizer_from=tokenizer)
  print(f"wrote {path}: step {meta.get('step')} of {run}, {sum(x.size for x in jax.tree.leaves(params)):,} parameters")
  return path


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  export(args.run, args.out, args.step, args.tokenizer)


if __name__ == "__main__":
  main()
