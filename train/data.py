"""Token data for the training script, and deterministic batches from it.

Sources:

* default (no download): the Python standard library's own ``.py`` sources,
  read in sorted path order and concatenated as bytes up to ``max_bytes``;
  each byte is a token (vocabulary 256). Real text on every Python install.
* ``--data FILE.bin``: ``uint16`` tokens in nanoGPT's ``.bin`` layout (read
  with ``np.memmap``, nothing loaded up front);
* ``--data FILE`` (any other extension): a file of text, tokenised as bytes,
  or by the run's tokenizer where it has one (``--tokenizer``, ``--init-from``;
  the default corpus too);
* ``--data FILE.jsonl`` (with a tokenizer): one JSON object a line, either
  ``{"text": ...}``, tokenised and packed with the end-of-sequence token
  after each row, or ``{"prompt": ..., "completion": ...}``, whose prompt's
  tokens are inputs only: the loss counts the completion's tokens (and its
  end-of-sequence token) alone.

A prompt's token ``t`` is stored as ``-1 - t`` (:func:`masked`): a window
reads it as ``t`` in ``x`` and as the target ``-1`` in ``y``, which the loss
skips (``models.lm.cross_entropy``).

A ``.jsonl``'s rows are examples (``--packing rows``, the default for them:
:func:`load_rows`, :func:`pack`): each sequence starts at a row, and rows
are packed whole into sequences of ``seq_len`` tokens, in the file's order,
a row that does not fit in what is left of one starting the next. Each
token has a segment id (its row's, from 1 in each sequence; 0 for the
padding that fills a sequence's end, never a target) and a position (from 0
at its row's start): the models attend within a segment only and place the
rotary or learned positions by it, so a row is computed as if alone. A row
longer than ``seq_len`` tokens is cut into pieces of ``seq_len``, each a
segment of its own. The target after a row's last input is its own last
token: no target crosses into the next row. The last ``val_fraction`` of the
rows is the validation split (:func:`split_rows`). ``--packing stream``
packs the rows one after another into one token stream instead, whose
sequences are windows of it, as for text.

Otherwise the first ``1 - val_fraction`` of the tokens is the training split,
the rest the validation split.

Batches are a pure function of ``(seed, step)``: batch ``i`` draws its
``batch`` window offsets (packed rows: sequence numbers) from
``np.random.default_rng([seed, 0, i])``. The data
position is therefore just the step number, and a resumed run sees exactly the
batches an uninterrupted run would have seen. Each process of a job reads only
its rows of each batch (``rows=``), so the global batch does not depend on the
number of processes.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

DEFAULT_MAX_BYTES = 4 * 2**20
VAL_FRACTION = 0.1  # the last tenth of the tokens is the validation split
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[str]:
  """The standard library's ``.py`` files, sorted by path relative to its root (third-party packages excluded)."""
  root = os.path.dirname(os.__file__)
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
    out.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  return sorted(out, key=lambda p: os.path.relpath(p, root))


def stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
  """The default corpus: stdlib sources concatenated (sorted order) up to ``max_bytes``, as ``uint8`` tokens."""
  chunks, total = [], 0
  for path in stdlib_files():
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError:
      continue
    data = data[: max_bytes - total]
    chunks.append(data)
    total += len(data)
    if total >= max_bytes:
      break
  if total == 0:
    raise ValueError(f"found no Python sources under {os.path.dirname(os.__file__)}; pass --data PATH.")
  return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def masked(tokens: np.ndarray) -> np.ndarray:
  """``tokens`` marked as inputs only (never a target): ``-1 - t`` each."""
  return -1 - np.asarray(tokens, np.int32)


def _jsonl_rows(path: str, tokenizer) -> tuple[list[np.ndarray], str]:
  """A ``.jsonl`` file's rows, each an int32 array (a prompt's tokens :func:`masked`), and the kinds of rows it held
  (the module docstring); ``ValueError`` naming the first line that is not a row of either kind."""
  parts, kinds = [], set()
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {number}: not JSON ({e}).") from None
      if isinstance(row, dict) and isinstance(row.get("text"), str):
        parts.append(np.asarray([*tokenizer.encode(row["text"]), tokenizer.eos_id], np.int32))
        kinds.add("text")
      elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        completion = np.asarray([*tokenizer.encode(row["completion"], special=False), tokenizer.eos_id], np.int32)
        parts.append(np.concatenate([masked(tokenizer.encode(row["prompt"])), completion]))
        kinds.add("prompt/completion")
      else:
        fields = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(
          f'{path} line {number}: a row needs a "text" string, or "prompt" and "completion" strings;'
          f" this one has {fields}."
        )
  if not parts:
    raise ValueError(f"{path} holds no rows; give one JSON object a line.")
  return parts, " and ".join(sorted(kinds))


def rows_of_jsonl(path: str, tokenizer) -> tuple[np.ndarray, str]:
  """A ``.jsonl`` file's rows as one int32 stream (``--packing stream``), and the kinds of rows it held."""
  parts, kinds = _jsonl_rows(path, tokenizer)
  return np.concatenate(parts), kinds


@dataclasses.dataclass(frozen=True)
class Rows:
  """A ``.jsonl``'s rows: row ``i`` is ``tokens[starts[i] : starts[i + 1]]`` (int32, a prompt's :func:`masked`)."""

  tokens: np.ndarray
  starts: np.ndarray  # int64, one more than the rows

  def __len__(self) -> int:
    return len(self.starts) - 1

  def __getitem__(self, part: slice) -> Rows:
    """The rows ``part`` (a slice of step 1) as :class:`Rows` of their own."""
    lo, hi, _ = part.indices(len(self))
    hi = max(lo, hi)
    return Rows(self.tokens[self.starts[lo] : self.starts[hi]], self.starts[lo : hi + 1] - self.starts[lo])


def load_rows(path: str, tokenizer) -> tuple[Rows, int, str]:
  """``(rows, vocab_size, description)`` of a ``.jsonl`` file (``--packing rows``), with :func:`load_tokens`' checks."""
  if not os.path.isfile(path):
    load_tokens(path, tokenizer=tokenizer)  # its message
  if not path.endswith(".jsonl") or tokenizer is None:
    raise ValueError(f"{path}: rows are a .jsonl's, read through a tokenizer (--tokenizer DIR, or --init-from DIR).")
  parts, kinds = _jsonl_rows(path, tokenizer)
  starts = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
  rows = Rows(np.concatenate(parts), starts)
  return rows, tokenizer.vocab_size, f"{path} ({len(rows):,} {kinds} rows, {len(rows.tokens):,} tokens)"


def split_rows(rows: Rows, val_fraction: float = VAL_FRACTION) -> tuple[Rows, Rows]:
  """The first ``1 - val_fraction`` of the rows for training, the rest for validation; ``ValueError`` unless each
  holds a row of two tokens or more (an input and its target)."""
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
  n = int(len(rows) * (1.0 - val_fraction))
  train, val = rows[:n], rows[n:]
  for name, part, share in (("training", train, 1 - val_fraction), ("validation", val, val_fraction)):
    if not (np.diff(part.starts) >= 2).any():
      raise ValueError(
        f"the data has {len(rows):,} rows; the {name} split (the {'first' if name == 'training' else 'last'}"
        f" {share:.0%} of them, {len(part):,}) holds no row of two tokens or more (an input and its target). Give"
        " more rows."
      )
  return train, val


@dataclasses.dataclass(frozen=True)
class Packed:
  """Rows packed into sequences (:func:`pack`): ``x``, ``y``, ``segments`` and ``positions``, int32
  ``[sequences, seq_len]``, and how many rows (``rows``) and row tokens (``filled``: not padding) they hold."""

  x: np.ndarray
  y: np.ndarray
  segments: np.ndarray
  positions: np.ndarray
  rows: int
  filled: int
  cut: int  # rows longer than a sequence, cut into pieces

  def __len__(self) -> int:
    return len(self.x)

  def describe(self) -> str:
    n, t = self.x.shape
    cut = f", {self.cut:,} rows cut into pieces of {t}" if self.cut else ""
    return f"{self.rows:,} rows in {n:,} sequences of {t} ({self.filled / self.x.size:.0%} of their tokens rows'{cut})"


def pack(rows: Rows, seq_len: int) -> Packed:
  """``rows`` packed whole into sequences of ``seq_len`` inputs (the module docstring), in order: a row's inputs are
  its tokens but the last, its targets its tokens but the first (``-1`` for a prompt's). A row of fewer than two
  tokens is left out; one of more than ``seq_len + 1`` is cut into pieces of ``seq_len`` inputs."""
  lengths = np.diff(rows.starts) - 1  # a row's inputs
  items = []  # (first token, inputs) of each segment
  for start, n in zip(rows.starts[:-1].tolist(), lengths.tolist()):
    items.extend((start + at, min(seq_len, n - at)) for at in range(0, max(n, 0), seq_len))
  where, sequence, used, segment = [], 0, 0, 0
  for _, n in items:
    if used + n > seq_len:
      sequence, used, segment = sequence + 1, 0, 0
    segment += 1
    where.append((sequence, used, segment))
    used += n
  count = sequence + 1 if items else 0
  x = np.zeros((count, seq_len), np.int32)
  y = np.full((count, seq_len), -1, np.int32)
  segments = np.zeros((count, seq_len), np.int32)
  positions = np.zeros((count, seq_len), np.int32)
  tokens = rows.tokens
  for (first, n), (s, at, k) in zip(items, where):
    inputs = tokens[first : first + n]
    x[s, at : at + n] = np.where(inputs < 0, -1 - inputs, inputs)
    y[s, at : at + n] = np.maximum(tokens[first + 1 : first + n + 1], -1)
    segments[s, at : at + n] = k
    positions[s, at : at + n] = np.arange(n)
  return Packed(x, y, segments, positions, int((lengths >= 1).sum()), sum(n for _, n in items),
                int((lengths > seq_len).sum()))  # fmt: skip


def _tokenized(raw: np.ndarray, tokenizer) -> np.ndarray:
  """UTF-8 text's bytes (``raw``, ``uint8``) as the tokenizer's int32 ids."""
  return np.asarray(tokenizer.encode(raw.tobytes().decode("utf-8", errors="replace")), np.int32)


def load_tokens(
  path: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES, tokenizer=None
) -> tuple[np.ndarray, int, str]:
  """Returns ``(tokens, vocab_size, description)``.

  ``path=None`` gives the stdlib corpus; ``*.bin`` is read as ``uint16``
  tokens (vocabulary 65536 at most: the model's ``vocab_size`` must cover the
  largest token, checked by the caller); ``*.jsonl`` as rows (with a
  ``tokenizer``: ``train.tokenizer.Tokenizer``); any other file as bytes
  (vocabulary 256), or as text through ``tokenizer`` where given (the stdlib
  corpus too; vocabulary the tokenizer's).
  """
  if path is None:
    tokens = stdlib_corpus(max_bytes)
    if tokenizer is not None:
      ids = _tokenized(tokens, tokenizer)
      return ids, tokenizer.vocab_size, f"Python stdlib sources ({len(tokens):,} bytes, {len(ids):,} tokens)"
    return tokens, 256, f"Python stdlib sources ({len(tokens):,} bytes)"
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"data file {path!r} not found. Pass --data with an existing text file or a nanoGPT-style uint16 .bin token"
      " file, or leave --data out to train on the Python standard library's sources."
    )
  size = os.path.getsize(path)
  if path.endswith(".jsonl"):
    if tokenizer is None:
      raise ValueError(f"{path}: JSONL rows are text; give a tokenizer (--tokenizer DIR, or --init-from DIR).")
    tokens, kinds = rows_of_jsonl(path, tokenizer)
    return tokens, tokenizer.vocab_size, f"{path} ({kinds} rows, {len(tokens):,} tokens)"
  if path.endswith(".bin"):
    if size < 2 or size % 2:
      raise ValueError(
        f"data file {path!r} has {size} bytes; a .bin token file must hold a whole, non-zero number of uint16"
        " tokens (nanoGPT layout: np.array(ids, dtype=np.uint16).tofile(path))."
      )
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    return tokens, 65536, f"{path} ({len(tokens):,} uint16 tokens)"
  if size == 0:
    raise ValueError(f"data file {path!r} is empty; give a text file with some content (it is read as bytes).")
  tokens = np.fromfile(path, dtype=np.uint8)
  if tokenizer is not None:
    ids = _tokenized(tokens, tokenizer)
    return ids, tokenizer.vocab_size, f"{path} ({len(tokens):,} bytes, {len(ids):,} tokens)"
  return tokens, 256, f"{path} ({len(tokens):,} bytes)"


@dataclasses.dataclass(frozen=True)
class Splits:
  train: np.ndarray | Packed  # a token stream, or packed rows (pack)
  val: np.ndarray | Packed


def split(tokens: np.ndarray, val_fraction: float = VAL_FRACTION) -> Splits:
  """First ``1 - val_fraction`` of the tokens for training, the rest for validation (views, no copy)."""
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
  n = int(len(tokens) * (1.0 - val_fraction))
  return Splits(tokens[:n], tokens[n:])


def _split_lengths(n: int, val_fraction: float) -> tuple[int, int]:
  train = int(n * (1.0 - val_fraction))  # split()'s rule
  return train, n - train


def min_tokens(seq_len: int, val_fraction: float = VAL_FRACTION) -> int:
  """The fewest tokens whose training and validation splits each hold one sequence (``seq_len + 1`` tokens)."""
  need = seq_len + 1
  n = max(2 * need, int(seq_len / val_fraction), int(seq_len / (1.0 - val_fraction)))  # no smaller n can do
  while min(_split_lengths(n, val_fraction)) < need:
    n += 1
  return n


def check_splits(splits: Splits, seq_len: int, val_fraction: float = VAL_FRACTION) -> None:
  """Raises ``ValueError`` unless both splits hold a sequence of ``seq_len`` and its next token.

  One message says it all: the data's tokens, both splits' lengths against
  what they need, and the ways out (the smallest file for this ``seq_len``,
  the largest ``--seq-len`` for this file).
  """
  need = seq_len + 1
  train, val = len(splits.train), len(splits.val)
  if min(train, val) >= need:
    return
  most = min(train, val) - 1  # the longest sequence both splits hold
  shorter = f", or --seq-len {most} or less" if most >= 1 else " (no --seq-len fits this file)"
  raise ValueError(
    f"the data has {train + val:,} tokens, too few for --seq-len {seq_len}: each split needs at least {need:,} (a"
    f" sequence and its next token); the training split (the first {1 - val_fraction:.0%}) has {train:,}, the"
    f" validation split (the last {val_fraction:.0%}) {val:,}. Give a file of at least"
    f" {min_tokens(seq_len, val_fraction):,} tokens{shorter}."
  )


TRAIN_STREAM, VAL_STREAM = 0, 1


def get_batch(
  tokens: np.ndarray | Packed,
  batch: int,
  seq_len: int,
  seed: int,
  index: int,
  stream: int = TRAIN_STREAM,
  rows: slice = slice(None),
) -> tuple[np.ndarray, ...]:
  """Batch number ``index``: ``(x, y)`` int32 ``[batch, seq_len]``, ``y`` = ``x`` shifted by one token, ``-1``
  where the next token is a prompt's (:func:`masked`: not a target). Of :class:`Packed` rows, ``batch`` of its
  sequences: ``(x, y, segments, positions)``.

  Window offsets come from ``np.random.default_rng([seed, stream, index])``, so
  the batch depends only on these three numbers (``stream`` separates training
  batches from validation batches). ``rows`` reads only those rows of it (a
  process's share): the same windows as in the whole batch, the others unread.
  """
  rng = np.random.default_rng([seed, stream, index])
  if isinstance(tokens, Packed):  # rows as examples: whole sequences, with their segment ids and positions
    if tokens.x.shape[1] != seq_len:
      raise ValueError(f"the rows are packed into sequences of {tokens.x.shape[1]}, not {seq_len}.")
    picks = rng.integers(0, len(tokens), size=batch)[rows]
    return tokens.x[picks], tokens.y[picks], tokens.segments[picks], tokens.positions[picks]
  starts = rng.integers(0, len(tokens) - seq_len, size=batch)[rows]
  windows = np.stack([np.asarray(tokens[s : s + seq_len + 1]) for s in starts]).astype(np.int32)
  if np.issubdtype(tokens.dtype, np.signedinteger):  # a stream with prompts' tokens in it
    return np.where(windows[:, :-1] < 0, -1 - windows[:, :-1], windows[:, :-1]), np.maximum(windows[:, 1:], -1)
  return windows[:, :-1], windows[:, 1:]
