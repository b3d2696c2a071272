"""A ``.jsonl``'s rows as examples (``train.data.pack``, ``--packing rows``): each sequence starts at a row, rows
packed together attend within themselves only and are placed from position 0, and the validation split is by rows."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_fine_tune import sentence, write_tokenizer

from models import gpt, llama, lm
from train import data as D
from train import gpt as T


def rows_of(*rows: np.ndarray) -> D.Rows:
  return D.Rows(np.concatenate(rows).astype(np.int32), np.cumsum([0, *map(len, rows)]).astype(np.int64))


def prompt_completion(rng: np.random.Generator, prompt: int, completion: int, vocab: int = 64) -> np.ndarray:
  return np.concatenate([D.masked(rng.integers(3, vocab, prompt)), rng.integers(3, vocab, completion)])


@pytest.mark.parametrize("arch", [llama, gpt])
def test_a_completions_logits_do_not_change_when_another_row_is_packed_before_it(arch):
  """Row ``b``'s logits alone in its sequence equal its logits after row ``a`` (rotary or learned positions alike),
  and the packed batch's loss is the mean over both rows' completions, each computed alone."""
  rng = np.random.default_rng(0)
  a, b = prompt_completion(rng, 7, 5), prompt_completion(rng, 6, 9)
  cfg = arch.get_config("tiny", vocab_size=64, block_size=32, n_layer=2, d_model=32)
  model = nnx.merge(*arch.init_params(cfg, seed=1))

  def logits(packed: D.Packed) -> jnp.ndarray:
    return model(*(jnp.asarray(v) for v in (packed.x, packed.segments, packed.positions)))

  alone, after = D.pack(rows_of(b), 32), D.pack(rows_of(a, b), 32)
  n, at = len(b) - 1, len(a) - 1  # b's inputs, and where they start after a's
  assert list(after.segments[0, : at + n + 1]) == [1] * at + [2] * n + [0]
  mine, packed = np.asarray(logits(alone)[0, :n]), np.asarray(logits(after)[0, at : at + n])
  np.testing.assert_allclose(packed, mine, rtol=0, atol=1e-5 * np.abs(mine).max())
  # Without the segments, a's tokens change b's logits: the mask is what keeps them apart.
  assert np.abs(np.asarray(model(jnp.asarray(after.x))[0, at : at + n]) - mine).max() > 1e-3
  batch = tuple(jnp.asarray(v) for v in (after.x, after.y, after.segments, after.positions))
  per_row = [lm.cross_entropy(logits(D.pack(rows_of(r), 32))[0], jnp.asarray(D.pack(rows_of(r), 32).y[0]))
             for r in (a, b)]  # fmt: skip
  counts = [(r[1:] >= 0).sum() for r in (a, b)]
  want = sum(float(loss) * c for loss, c in zip(per_row, counts)) / sum(counts)
  np.testing.assert_allclose(float(lm.loss(*nnx.split(model, nnx.Param), batch)), want, rtol=1e-5)


def test_packing_starts_each_sequence_at_a_row_and_keeps_every_target_once():
  rng = np.random.default_rng(1)
  rows = [prompt_completion(rng, int(rng.integers(0, 6)), int(rng.integers(1, 12))) for _ in range(30)]
  rows.append(prompt_completion(rng, 4, 30))  # 33 inputs: cut into pieces of 16, 16 and 1
  rows.append(np.asarray([5], np.int32))  # no target: left out
  packed = D.pack(rows_of(*rows), 16)
  assert packed.rows == 31 and packed.cut == 1
  starts = np.diff(packed.segments, prepend=-1, axis=1) != 0  # a segment's first input
  assert (packed.positions[starts] == 0).all() and (packed.positions[:, 0] == 0).all()
  assert (packed.segments[:, 0] == 1).all()  # each sequence starts at a row (or a piece of one)
  assert (packed.y[packed.segments == 0] == -1).all()  # padding is never a target
  # Every row's targets, in order, once: none crosses into the next row.
  targets = packed.y[packed.segments > 0]
  np.testing.assert_array_equal(targets, np.concatenate([np.maximum(r[1:], -1) for r in rows]))
  inputs = packed.x[packed.segments > 0]
  np.testing.assert_array_equal(inputs, np.concatenate([np.where(r[:-1] < 0, -1 - r[:-1], r[:-1]) for r in rows]))
  x, y, segments, positions = D.get_batch(packed, 5, 16, seed=0, index=3)
  picks = np.random.default_rng([0, D.TRAIN_STREAM, 3]).integers(0, len(packed), 5)
  np.testing.assert_array_equal(segments, packed.segments[picks])
  with pytest.raises(ValueError, match="packed into sequences of 16, not 8"):
    D.get_batch(packed, 5, 8, seed=0, index=3)


def test_the_validation_split_is_by_rows(tmp_path):
  """The last tenth of the rows is the validation split, each row whole in it; ``train.gpt`` packs each split."""
  from train import flags as F

  rng = np.random.default_rng(2)
  tok = write_tokenizer(tmp_path / "tok")
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps({"prompt": sentence(rng, int(rng.integers(2, 6))),
                                      "completion": sentence(rng, int(rng.integers(1, 8)))}) + "\n"
                          for _ in range(25)))  # fmt: skip
  rows, _, desc = D.load_rows(str(path), tok)
  assert len(rows) == 25 and "25 prompt/completion rows" in desc
  np.testing.assert_array_equal(rows.tokens, D.load_tokens(str(path), tokenizer=tok)[0])  # --packing stream's
  train, val = D.split_rows(rows)
  assert (len(train), len(val)) == (22, 3)
  np.testing.assert_array_equal(np.concatenate([train.tokens, val.tokens]), rows.tokens)
  assert val.starts[0] == 0 and rows.starts[22] == len(train.tokens)  # the split falls between rows
  args = F.parse_args(["--arch", "llama", "--tokenizer", str(tmp_path / "tok"), "--data", str(path), "--seq-len",
                       "16", "--out", str(tmp_path / "run")])  # fmt: skip
  assert args.packing == "rows"
  splits, _, _ = T._load_data(args)
  assert (splits.train.rows, splits.val.rows) == (22, 3)
  val_targets = [np.maximum(r[1:], -1) for r in np.split(val.tokens, val.starts[1:-1])]
  np.testing.assert_array_equal(splits.val.y[splits.val.segments > 0], np.concatenate(val_targets))
  with pytest.raises(ValueError, match="the training split .* holds no row"):
    D.split_rows(rows[:1])


def test_packing_rows_needs_a_jsonl_and_stream_keeps_the_windows(tmp_path, capsys):
  from train import flags as F

  text = tmp_path / "a.txt"
  text.write_text("some text " * 100)
  with pytest.raises(SystemExit):
    F.parse_args(["--data", str(text), "--packing", "rows"])
  assert "--packing rows packs a .jsonl's rows into sequences" in capsys.readouterr().err
  assert F.parse_args(["--data", str(text)]).packing == "stream"


def test_a_gpt_trains_on_rows_with_the_plain_and_the_overlapped_step_alike(tmp_path):
  """GPT (learned positions) on prompt/completion rows: the overlapped step's stages get the segments and positions
  and give the plain step's losses."""
  rng = np.random.default_rng(3)
  write_tokenizer(tmp_path / "tok")
  path = tmp_path / "rows.jsonl"
  path.write_text("".join(json.dumps({"prompt": sentence(rng, 3), "completion": sentence(rng, 4)}) + "\n"
                          for _ in range(60)))  # fmt: skip
  flags = ["--arch", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "2", "--vocab-size", "64", "--tokenizer",
           str(tmp_path / "tok"), "--data", str(path), "--batch", "2", "--seq-len", "24", "--steps", "3",
           "--eval-every", "0", "--eval-batches", "1", "--log-every", "1", "--param-dtype", "float32", "--no-ckpt",
           "--quiet"]  # fmt: skip
  plain = T.main([*flags, "--out", str(tmp_path / "plain"), "--overlap", "off"])
  overlapped = T.main([*flags, "--out", str(tmp_path / "overlapped"), "--overlap", "on"])
  losses = [plain["losses"][s] for s in (1, 2, 3)]
  np.testing.assert_allclose([overlapped["losses"][s] for s in (1, 2, 3)], losses, rtol=1e-5)
  assert np.isfinite(losses).all() and np.isfinite(plain["val_losses"][3])
