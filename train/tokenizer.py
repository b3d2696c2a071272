"""A Hugging Face tokenizer for the training script (``--tokenizer DIR``): its ``tokenizer.json``, read through the
``tokenizers`` library, and the end-of-sequence token that separates packed rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Where a folder names its end-of-sequence token, in the order looked at.
EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>", "<eos>")


class Tokenizer:
  """``tokenizer.json`` of a folder: :meth:`encode`, :attr:`eos_id`, :attr:`vocab_size`."""

  def __init__(self, folder: str | os.PathLike):
    from tokenizers import Tokenizer as HFTokenizer

    self.folder = Path(folder)
    file = self.folder / "tokenizer.json"
    if not file.exists():
      raise FileNotFoundError(
        f"{file}: no such file; --tokenizer names a folder holding a Hugging Face tokenizer.json (by default the"
        " --init-from checkpoint's folder)."
      )
    self._tokenizer = HFTokenizer.from_file(str(file))
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._eos_id()

  def _eos_id(self) -> int:
    """The end-of-sequence id: ``tokenizer_config.json``'s ``eos_token``, else the first of :data:`EOS_NAMES` the
    vocabulary has, else ``config.json``'s ``eos_token_id``."""
    names = []
    config = self.folder / "tokenizer_config.json"
    if config.exists():
      eos = json.loads(config.read_text()).get("eos_token")
      names.append(eos.get("content") if isinstance(eos, dict) else eos)
    for name in [n for n in names if n] + list(EOS_NAMES):
      found = self._tokenizer.token_to_id(name)
      if found is not None:
        return found
    model = self.folder / "config.json"
    ids = json.loads(model.read_text()).get("eos_token_id") if model.exists() else None
    ids = ids[0] if isinstance(ids, list) and ids else ids
    if isinstance(ids, int):
      return ids
    raise ValueError(
      f"{self.folder}: no end-of-sequence token found (tokenizer_config.json's eos_token, one of"
      f" {', '.join(EOS_NAMES)}, or config.json's eos_token_id); packed rows need one between them."
    )

  def encode(self, text: str, special: bool = True) -> list[int]:
    """``text``'s token ids; ``special``: with the tokenizer's own additions (a beginning-of-sequence token)."""
    return self._tokenizer.encode(text, add_special_tokens=special).ids
