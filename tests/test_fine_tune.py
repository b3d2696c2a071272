"""Fine-tuning a Hugging Face checkpoint: ``python -m train.gpt --init-from DIR`` on JSONL rows, and
``python -m train.export`` back to a checkpoint transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_hf import V, _read, write_checkpoint

from models import hf, lm
from train import data as D
from train import export as E
from train import gpt as T
from train.tokenizer import Tokenizer

WORDS = ("the cat sat on a mat and the dog ran to the red ball while birds sang in green trees near blue water"
         " question answer what is who where why how yes no").split()  # fmt: skip


def write_tokenizer(folder: Path) -> Tokenizer:
  """A word-level tokenizer.json (the ``tokenizers`` library) of :data:`WORDS` and ``<unk> <s> </s>``, which puts
  ``<s>`` before a text."""
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import models, pre_tokenizers, processors

  vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *dict.fromkeys(WORDS)])}
  assert len(vocab) <= V
  tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  folder.mkdir(parents=True, exist_ok=True)
  tok.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
  return Tokenizer(folder)


def sentence(rng: np.random.Generator, n: int) -> str:
  return " ".join(rng.choice(WORDS, n))


def test_prompt_tokens_are_inputs_and_carry_no_gradient(tmp_path):
  """A prompt/completion row's prompt tokens are read as inputs and never as targets: the loss is the mean over the
  completion's (and end-of-sequence) targets alone, and its gradient is zero at every prompt position."""
  rng = np.random.default_rng()
  tok = write_tokenizer(tmp_path / "tok")
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": sentence(rng, 5), "completion": sentence(rng, 4)}) + "\n"
                          for _ in range(40)))  # fmt: skip
  tokens, vocab, desc = D.load_tokens(str(rows), tokenizer=tok)
  assert vocab == tok.vocab_size and "prompt/completion rows" in desc
  assert (tokens < 0).any() and (tokens >= 0).any()
  x, y = D.get_batch(tokens, 4, 16, seed=0, index=0)
  assert x.min() >= 0 and (y == -1).any() and (y >= 0).any()
  # x holds every token; y is x shifted, with a prompt's tokens as -1.
  np.testing.assert_array_equal(np.where(y[:, :-1] >= 0, y[:, :-1], x[:, 1:]), x[:, 1:])
  logits = jnp.asarray(rng.standard_normal((4, 16, vocab)), jnp.float32)
  loss, grad = jax.value_and_grad(lm.cross_entropy)(logits, jnp.asarray(y))
  counted = y >= 0
  want = optax.softmax_cross_entropy_with_integer_labels(logits[counted], jnp.asarray(y[counted])).mean()
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  assert float(jnp.abs(grad[~counted]).max()) == 0.0 and float(jnp.abs(grad[counted]).max()) > 0


def test_init_from_takes_the_checkpoints_model_and_fine_tuning_defaults(tmp_path):
  from train import flags as F

  write_checkpoint(tmp_path / "Some-Model", "qwen2", np.random.default_rng())
  args = F.parse_args(["--init-from", str(tmp_path / "Some-Model"), "--steps", "1000"])
  assert (args.arch, args.lr, args.warmup, args.seq_len) == ("llama", 2e-5, 30, 64) and args.min_lr == args.lr / 10
  assert args.tokenizer == str(tmp_path / "Some-Model") and args.out == str(Path("runs") / "Some-Model")
  cfg = F.model_config(args)
  assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.vocab_size, cfg.rope_theta) == (True, True, V, 1e6)


def test_bad_rows_and_tokenizers_get_one_line_and_nothing_is_written(tmp_path, capsys):
  rng = np.random.default_rng()
  write_checkpoint(tmp_path / "model", "llama3", rng)
  write_tokenizer(tmp_path / "model")
  rows = tmp_path / "rows.jsonl"
  rows.write_text(json.dumps({"text": "the cat"}) + "\n" + json.dumps({"question": "who"}) + "\n")
  out = tmp_path / "run"
  base = ["--init-from", str(tmp_path / "model"), "--steps", "1", "--out", str(out), "--quiet"]
  with pytest.raises(SystemExit, match=r"rows.jsonl line 2: a row needs a \"text\" string.*\['question'\]"):
    T.main([*base, "--data", str(rows)])
  big = tmp_path / "big"
  big.mkdir()
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import models

  HFTokenizer(models.WordLevel({f"w{i}": i for i in range(V + 10)}, unk_token="w0")).save(str(big / "tokenizer.json"))
  (big / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1"}))
  with pytest.raises(SystemExit, match=f"its vocabulary has {V + 10} tokens, more than the {V} of"):
    T.main([*base, "--tokenizer", str(big)])
  with pytest.raises(SystemExit):
    T.main([*base, "--preset", "small"])
  assert "--init-from takes the model from" in capsys.readouterr().err
  assert not out.exists()


def test_init_from_trains_on_prompt_completion_rows_and_exports_what_transformers_loads(tmp_path, monkeypatch):
  """``--init-from`` starts from the checkpoint's weights (its first loss is the checkpoint's model's), trains a few
  steps of prompt/completion rows with the fine-tuning defaults, on the plain and the overlapped step; the export
  of its checkpoint loads in transformers with the trained weights' logits."""
  from test_hf import reference_logits

  rng = np.random.default_rng()
  model_dir = tmp_path / "model"
  write_checkpoint(model_dir, "llama3", rng)
  tok = write_tokenizer(model_dir)
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": "question " + sentence(rng, 6), "completion": sentence(rng, 5)})
                          + "\n" for _ in range(200)))  # fmt: skip
  flags = [
    "--init-from",
    str(model_dir),
    "--data",
    str(rows),
    "--batch",
    "4",
    "--seq-len",
    "16",
    "--steps",
    "6",
    "--eval-every",
    "0",
    "--eval-batches",
    "1",
    "--log-every",
    "1",
    "--param-dtype",
    "float32",
    "--lr",
    "1e-2",
  ]  # fmt: skip  (a large rate: a few steps must show the loss fall)
  plain = T.main([*flags, "--out", str(tmp_path / "plain")])
  overlapped = T.main([*flags, "--out", str(tmp_path / "overlapped"), "--overlap", "on", "--no-ckpt"])
  np.testing.assert_allclose([overlapped["losses"][s] for s in range(1, 7)], [plain["losses"][s] for s in range(1, 7)],
                             rtol=1e-5)  # fmt: skip
  # The first step's loss is the checkpoint's own model's on that batch (its weights were read, not drawn).
  # The rows are examples (--packing rows): the first batch is four of the training rows' packed sequences.
  train_rows = D.split_rows(D.load_rows(str(rows), tok)[0])[0]
  x, y, *segments = (jnp.asarray(a) for a in D.get_batch(D.pack(train_rows, 16), 4, 16, seed=0, index=0))
  start = hf.load(model_dir)
  np.testing.assert_allclose(plain["losses"][1], float(lm.cross_entropy(start(x, *segments), y)), rtol=1e-5)
  # Trained: the loss on that same batch falls (one step's loss on its own batch is too noisy to compare).
  trained_model = nnx.merge(nnx.graphdef(start), plain["params"])
  trained_loss = float(lm.cross_entropy(trained_model(x, *segments), y))
  assert trained_loss < plain["losses"][1] - 0.2, (trained_loss, plain["losses"])
  # Exported: config, safetensors and the tokenizer's files; transformers' logits are the trained model's.
  out = E.export(tmp_path / "plain", tmp_path / "exported")
  assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
  trained = hf.load(out)
  for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(trained, nnx.Param))), jax.tree.leaves(plain["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tokens = rng.integers(0, V, (2, 10)).astype(np.int32)
  ours = np.asarray(trained(jnp.asarray(tokens)))
  theirs = reference_logits(out, tokens, monkeypatch)
  scale = float(np.max(np.abs(theirs)))
  assert float(np.max(np.abs(ours - theirs))) <= 1e-4 * scale
  assert sorted(_read(out / "model.safetensors")) == sorted(_read(model_dir / "model.safetensors"))


def test_a_transformers5_qwen3_fine_tunes_in_bfloat16_and_exports_its_float32_master(tmp_path):
  """A Qwen3 that transformers 5 wrote (``tests/fixtures/hf5``: q/k norms, its own head width) trains bfloat16
  parameters with a float32 master (``--offload host``); the export defaults to the source's float32 and writes the
  master, not the rounded parameters, keeping the family, the token ids and ``generation_config.json``; ``--dtype
  bfloat16`` writes the parameters."""
  import shutil

  import jax_dos
  from models import llama

  fixture = Path(__file__).parent / "fixtures" / "hf5" / "qwen3"
  model_dir = tmp_path / "qwen3"
  shutil.copytree(fixture, model_dir, ignore=shutil.ignore_patterns("reference.npz"))
  write_tokenizer(model_dir)
  rng = np.random.default_rng()
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": "question " + sentence(rng, 6), "completion": sentence(rng, 5)})
                          + "\n" for _ in range(100)))  # fmt: skip
  T.main(["--init-from", str(model_dir), "--data", str(rows), "--batch", "2", "--seq-len", "16", "--steps", "3",
          "--eval-every", "0", "--eval-batches", "1", "--offload", "host", "--param-dtype", "bfloat16", "--lr", "1e-2",
          "--out", str(tmp_path / "run"), "--quiet"])  # fmt: skip
  out = E.export(tmp_path / "run", tmp_path / "float32")
  config, source = json.loads((out / "config.json").read_text()), hf.read_config(model_dir)
  assert (config["model_type"], config["head_dim"], config["dtype"]) == ("qwen3", 16, "float32")
  assert (config["bos_token_id"], config["eos_token_id"]) == (source["bos_token_id"], source["eos_token_id"])
  assert json.loads((out / "generation_config.json").read_text()) == json.loads(
    (model_dir / "generation_config.json").read_text())  # fmt: skip
  with jax_dos.CheckpointManager(tmp_path / "run" / "ckpt") as manager:
    cfg = llama.LlamaConfig(**manager.meta()["config"])
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), llama.abstract_params(cfg))
    master, _ = manager.restore_master(params=template)
    params, _ = manager.restore_params(params=template)
  assert cfg.qk_norm and cfg.param_dtype == "bfloat16"
  written = _read(out / "model.safetensors")
  ours = {theirs: path for path, theirs in hf.tensor_names(cfg)}
  rounded = 0
  for name, path in ours.items():
    m, p = hf._get(master, path), hf._get(params, path)
    want = np.asarray(m).T if path[-1] == hf.TRANSPOSED else np.asarray(m)
    np.testing.assert_array_equal(written[name], want, err_msg=name)
    rounded += not np.array_equal(np.asarray(m), np.asarray(p.astype(jnp.float32)))
  assert rounded > 0  # the master is not the bfloat16 parameters
  E.main([str(tmp_path / "run"), str(tmp_path / "bf16"), "--dtype", "bfloat16"])
  halves = _read(tmp_path / "bf16" / "model.safetensors")
  for name, path in ours.items():
    p = np.asarray(hf._get(params, path))
    np.testing.assert_array_equal(halves[name], p.T if path[-1] == hf.TRANSPOSED else p, err_msg=name)
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
