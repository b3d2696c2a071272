"""A Hugging Face checkpoint folder with random weights and a tokenizer, and prompt/completion rows for it: what a
fine-tuning run (``python -m train.gpt --init-from DIR --data ROWS``) reads, where no model hub can be reached.

    python bench/pretrained_checkpoint.py --preset llama-7b --out /tmp/llama-7b --rows /tmp/rows.jsonl

* The model: ``models.llama``'s preset with random weights (``--dtype``, bfloat16 by default, as published 7B
  checkpoints are), written by ``models.hf.save``: ``config.json``, safetensors shards and their index.
* The tokenizer: a byte-level BPE of ``--vocab`` tokens (the ``tokenizers`` library) trained on the built-in corpus
  (the standard library's sources, ``train.data.stdlib_corpus``), with ``<s>`` and ``</s>``; its ``tokenizer.json``
  and ``tokenizer_config.json`` are copied into the checkpoint folder (the run's ``--tokenizer`` default).
* The rows: each top-level ``def`` of the corpus as ``{"prompt": its signature line, "completion": its body}``.

Prints the time each part took and the folder's size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from models import hf, llama
from train import data

SPECIALS = ("<s>", "</s>")


def write_tokenizer(folder: Path, text: str, vocab: int) -> None:
  """A byte-level BPE of ``vocab`` tokens trained on ``text``, saved as ``folder/tokenizer.json`` with a
  ``tokenizer_config.json`` naming its EOS (``</s>``) and BOS (``<s>``)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
  tok.train_from_iterator(text.splitlines(), trainer)
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def write_rows(path: Path, text: str) -> int:
  """Each top-level function of ``text`` as a prompt (its ``def`` line) and a completion (its body); returns the
  number of rows."""
  rows = 0
  with open(path, "w") as f:
    for chunk in re.split(r"\n(?=def )", text):
      head, _, body = chunk.partition("\n")
      if head.startswith("def ") and body.strip():
        body = body.split("\n\n\n")[0]
        f.write(json.dumps({"prompt": head + "\n", "completion": body}) + "\n")
        rows += 1
  return rows


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", default="llama-7b", choices=sorted(llama.PRESETS))
  p.add_argument("--out", required=True, help="the checkpoint folder to write")
  p.add_argument("--rows", required=True, help="the JSONL file of prompt/completion rows to write")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--vocab", type=int, default=8192, help="the tokenizer's vocabulary (at most the model's)")
  p.add_argument("--model-vocab", type=int, default=None, help="the model's vocabulary (default: the preset's)")
  p.add_argument("--corpus-mb", type=int, default=32, help="megabytes of the built-in corpus to take")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  text = data.stdlib_corpus(args.corpus_mb * 2**20).tobytes().decode("utf-8", "replace")
  vocab = {"vocab_size": args.model_vocab} if args.model_vocab else {}
  cfg = llama.get_config(args.preset, param_dtype=args.dtype, dtype=args.dtype, **vocab)
  if args.vocab > cfg.vocab_size:
    sys.exit(f"error: --vocab {args.vocab} is more than the model's {cfg.vocab_size}.")
  with tempfile.TemporaryDirectory() as tmp:
    write_tokenizer(Path(tmp), text, args.vocab)
    t1 = time.perf_counter()
    graphdef, params = llama.init_params(cfg, args.seed)
    jax.block_until_ready(params)
    t2 = time.perf_counter()
    hf.save(nnx.merge(graphdef, params), args.out, tokenizer_from=tmp)
    t3 = time.perf_counter()
  del params
  rows = write_rows(Path(args.rows), text)
  size = sum(f.stat().st_size for f in Path(args.out).iterdir())
  print(
    f"tokenizer {t1 - t0:.1f} s, init {t2 - t1:.1f} s ({llama.param_count(cfg) / 1e9:.2f}B, {args.dtype}),"
    f" save {t3 - t2:.1f} s ({size / 2**30:.1f} GiB in {len(os.listdir(args.out))} files), {rows} rows"
  )


if __name__ == "__main__":
  main()
