"""A run's weights as a Hugging Face checkpoint: ``python -m train.export RUN DIR``.

    python -m train.export runs/Qwen2.5-7B out/qwen-sft          # the newest checkpoint that verifies
    python -m train.export runs/llama-tiny out/tiny --step 200 --dtype float32

Reads the weights of ``RUN/ckpt`` (``jax_dos.CheckpointManager``: every file
verified first, nothing of the moments read) and writes ``DIR`` as
``models.hf.save_params`` does: ``config.json``, safetensors shards in
``--dtype``, ``generation_config.json`` and the tokenizer's files of the run
(its ``--tokenizer``, by default its ``--init-from`` folder). transformers 4
and 5 load the folder. Only ``--arch llama`` runs (the Llama family) have a
Hugging Face form here.

* ``--dtype`` defaults to the dtype of the checkpoint the run started from
  (``--init-from``'s ``config.json``; a run from scratch: its parameters').
  ``float32`` of a run that trains bfloat16 parameters reads the optimizer's
  float32 master weights, not the rounded parameters.
* A fine-tune's export keeps its source's config (the family, the token ids,
  the context length) and ``generation_config.json``: the run's checkpoints
  hold both (``train.gpt.hf_source``).
* It runs on jax's CPU backend (:func:`host_only`, before jax starts one) and
  reads the arrays into host memory: an export beside a training run that
  holds the GPU takes nothing of it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import jax

import jax_dos
from models import hf, llama


def host_only() -> bool:
  """Makes jax's CPU backend the only one where no backend has started yet (a tool that only reads and writes
  checkpoints needs no accelerator, and the one a training run holds may have no memory to spare); returns whether
  it did (an interpreter whose backends have started keeps them)."""
  try:
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
      return False
  except (ImportError, AttributeError):  # a jax without it: the update below is ignored once a backend has started
    pass
  jax.config.update("jax_platforms", "cpu")
  return True


def build_parser() -> argparse.ArgumentParser:
  from train.flags import Parser

  p = Parser(prog="python -m train.export", description=__doc__.split("\n")[0])
  p.add_argument("run", help="the run's --out folder (holding ckpt/)")
  p.add_argument("out", help="the folder to write the Hugging Face checkpoint in (created; files in it replaced)")
  p.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest that verifies)")
  p.add_argument("--tokenizer", default=None, help="copy the tokenizer's files from this folder (default: the run's)")
  p.add_argument("--dtype", choices=llama.DTYPES, default=None,
                 help="the tensors' dtype (default: that of the checkpoint the run started from, else of its"
                      " parameters); float32 reads the float32 master weights where the run has them")  # fmt: skip
  return p


def source_dtype(source: dict[str, Any] | None) -> str | None:
  """The dtype a Hugging Face config says its tensors are in (``dtype``, or transformers 4's ``torch_dtype``), where
  it is one of :data:`models.llama.DTYPES`."""
  if not source:
    return None
  dtype = source.get("dtype") or source.get("torch_dtype")
  return dtype if dtype in llama.DTYPES else None


def export(run: str | os.PathLike, out: str | os.PathLike, step: int | None = None,
           tokenizer: str | os.PathLike | None = None, dtype: str | None = None) -> Path:  # fmt: skip
  """Writes ``run``'s checkpoint ``step`` (default the newest that verifies) to ``out`` in ``dtype`` (default: as the
  module docstring says); returns ``out``. The arrays are read to jax's CPU device. Errors are ``SystemExit`` s
  naming what to change."""
  ckpt = os.path.join(run, "ckpt")
  if not os.path.isdir(ckpt):
    raise SystemExit(f"error: {ckpt}: no such folder; give a run's --out folder (python -m train.gpt --out RUN).")
  if dtype is not None and dtype not in llama.DTYPES:
    raise SystemExit(f"error: --dtype {dtype}: choose one of {', '.join(llama.DTYPES)}.")
  with jax_dos.CheckpointManager(ckpt) as manager:
    try:
      meta = manager.meta(step)
    except FileNotFoundError as e:
      raise SystemExit(f"error: {e}") from None
    saved_args = meta.get("args", {})
    arch = saved_args.get("arch", "gpt")
    if arch != "llama":
      raise SystemExit(
        f"error: {run} trained --arch {arch}; a Hugging Face checkpoint is written for --arch llama runs (the Llama"
        " family: models/llama.py) only."
      )
    cfg = llama.LlamaConfig(**meta["config"])
    source, generation = meta.get("hf_config"), meta.get("hf_generation_config")
    init_from = saved_args.get("init_from")
    if source is None and init_from is not None and os.path.isfile(os.path.join(init_from, hf.CONFIG)):
      source = hf.read_config(init_from)  # a run from before its checkpoints kept the source's config
    dtype = dtype or source_dtype(source) or cfg.param_dtype
    host = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=host), llama.abstract_params(cfg))
    try:
      params, meta = manager.restore_params(step, params=template)
      what = f"its {cfg.param_dtype} parameters"
      if dtype == "float32" and cfg.param_dtype != "float32":
        master = manager.restore_master(meta["step"], params=template)
        if master is None:
          print(f"note: {run} holds no float32 master weights: its {cfg.param_dtype} parameters are written as float32",
                file=sys.stderr)  # fmt: skip
        else:
          params, what = master[0], "its float32 master weights"
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: {e}") from None
  tokenizer = tokenizer or saved_args.get("tokenizer") or init_from
  if tokenizer is not None and not os.path.isdir(tokenizer):
    print(f"note: the run's tokenizer folder {tokenizer} is not here: no tokenizer files copied", file=sys.stderr)
    tokenizer = None
  path = hf.save_params(cfg, params, out, tokenizer_from=tokenizer, dtype=dtype, source=source, generation=generation)
  count = sum(x.size for x in jax.tree.leaves(params))
  print(f"wrote {path}: step {meta.get('step')} of {run}, {count:,} parameters in {dtype} ({what})")
  return path


def main(argv: list[str] | None = None) -> None:
  args = build_parser().parse_args(argv)
  host_only()
  export(args.run, args.out, args.step, args.tokenizer, args.dtype)


if __name__ == "__main__":
  main()
