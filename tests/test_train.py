"""train/: the data pipeline and the training script, run end to end on tiny models."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import jax
import numpy as np
import optax
import pytest
import tqdm

from models import gpt as gpt_model
from train import data as D
from train import flags as F
from train import gpt as T
from train import gradients as G
from train import optimizer as O
from train import parallel as M
from train import plot
from train import progress as P
from train import steps as S

# A model small enough that each run takes seconds on a CPU.
TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--batch", "4", "--seq-len", "32", "--eval-batches", "1",
        "--quiet"]  # fmt: skip
HAVE_CHECKPOINT = importlib.util.find_spec("jax_dos.checkpoint") is not None


def _run(tmp_path, name: str, *flags: str) -> dict:
  return T.main([*TINY, "--out", str(tmp_path / name), *flags])


def _same_tree(a, b) -> bool:
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.array_equal(np.asarray(x), np.asarray(y)) and x.dtype == y.dtype
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ----------------------------------------------------------------------------- data


def test_stdlib_corpus_is_deterministic_real_text():
  a, b = D.stdlib_corpus(50_000), D.stdlib_corpus(50_000)
  assert a.dtype == np.uint8 and len(a) == 50_000
  np.testing.assert_array_equal(a, b)
  assert b"def " in a.tobytes() and b"import " in a.tobytes()
  files = D.stdlib_files()
  assert files == sorted(files, key=lambda p: os.path.relpath(p, os.path.dirname(os.__file__)))
  assert not any("site-packages" in f for f in files)


def test_split_and_batches_are_deterministic():
  tokens = np.arange(1000, dtype=np.uint16)
  s = D.split(tokens, 0.1)
  assert len(s.train) == 900 and len(s.val) == 100
  np.testing.assert_array_equal(np.concatenate([s.train, s.val]), tokens)
  x, y = D.get_batch(s.train, 5, 16, seed=3, index=7)
  x2, y2 = D.get_batch(s.train, 5, 16, seed=3, index=7)
  np.testing.assert_array_equal(x, x2)
  np.testing.assert_array_equal(y, y2)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
  assert x.shape == (5, 16) and x.dtype == np.int32 and int(y.max()) < 900
  assert not np.array_equal(x, D.get_batch(s.train, 5, 16, seed=3, index=8)[0])
  assert not np.array_equal(x, D.get_batch(s.train, 5, 16, seed=3, index=7, stream=D.VAL_STREAM)[0])


def test_a_process_reads_its_rows_of_the_same_batch():
  tokens = np.random.default_rng().integers(0, 256, 1000).astype(np.uint8)
  whole = D.get_batch(tokens, 8, 16, 0, 3)
  for rows in (slice(0, 4), slice(4, 8), slice(2, 3)):
    for part, full in zip(D.get_batch(tokens, 8, 16, 0, 3, rows=rows), whole):
      np.testing.assert_array_equal(part, full[rows])


def test_joining_a_job_needs_the_whole_coordinator():
  assert M.join_from_environment({}) is False  # one process: nothing to join
  assert M.join_from_environment({"SLURM_NTASKS": "1"}) is False
  with pytest.raises(SystemExit, match="JAX_PROCESS_ID"):
    M.join_from_environment({"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_NUM_PROCESSES": "2"})


def test_bin_file_is_memory_mapped_uint16(tmp_path):
  ids = np.random.default_rng(0).integers(0, 50257, 5000).astype(np.uint16)
  path = tmp_path / "train.bin"
  ids.tofile(path)
  tokens, vocab, desc = D.load_tokens(str(path))
  assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and vocab == 65536
  np.testing.assert_array_equal(tokens, ids)
  assert "5,000" in desc


def test_text_file_is_read_as_bytes(tmp_path):
  path = tmp_path / "corpus.txt"
  path.write_text("héllo world\n" * 10)
  tokens, vocab, _ = D.load_tokens(str(path))
  assert vocab == 256
  assert tokens.tobytes() == path.read_bytes()


@pytest.mark.parametrize(
  "content, name, match",
  [(None, "missing.txt", "not found"), (b"", "empty.txt", "is empty"), (b"\x01\x02\x03", "odd.bin", "uint16")],
)
def test_bad_data_files(tmp_path, content, name, match):
  path = tmp_path / name
  if content is not None:
    path.write_bytes(content)
  with pytest.raises((FileNotFoundError, ValueError), match=match) as e:
    D.load_tokens(str(path))
  assert str(path) in str(e.value)
  with pytest.raises(SystemExit, match=match):  # the script turns it into a clean exit naming the flag
    _run(tmp_path, "run", "--data", str(path), "--steps", "1")


def test_bin_tokens_beyond_the_vocabulary_are_an_error(tmp_path):
  path = tmp_path / "tokens.bin"
  np.arange(2000, dtype=np.uint16).tofile(path)
  with pytest.raises(SystemExit, match="--vocab-size above"):
    _run(tmp_path, "run", "--data", str(path), "--vocab-size", "1000", "--steps", "1")


def test_data_shorter_than_a_sequence_is_an_error(tmp_path):
  path = tmp_path / "short.txt"
  path.write_bytes(b"print('hi')\n")
  with pytest.raises(SystemExit, match="seq-len"):
    _run(tmp_path, "run", "--data", str(path), "--steps", "1")


@pytest.mark.parametrize("size", [12, 200, 300])
def test_a_short_validation_split_is_one_message_with_every_way_out(size):
  seq_len = 32  # TINY's
  splits = D.split(np.zeros(size, np.uint8))
  with pytest.raises(ValueError) as e:
    D.check_splits(splits, seq_len)
  msg = str(e.value)
  assert f"{size:,} tokens" in msg and f"--seq-len {seq_len}" in msg
  assert f"has {len(splits.train):,}" in msg and f"(the last 10%) {len(splits.val):,}" in msg  # both splits
  smallest = int(re.search(r"a file of at least ([\d,]+) tokens", msg).group(1).replace(",", ""))
  D.check_splits(D.split(np.zeros(smallest, np.uint8)), seq_len)  # that size is enough...
  with pytest.raises(ValueError):
    D.check_splits(D.split(np.zeros(smallest - 1, np.uint8)), seq_len)  # ...and the smallest that is
  longest = int(re.search(r"--seq-len (\d+) or less", msg).group(1))
  D.check_splits(splits, longest)  # this file trains at that --seq-len, and not one more
  with pytest.raises(ValueError):
    D.check_splits(splits, longest + 1)


def test_data_too_short_for_any_sequence_says_so():
  with pytest.raises(ValueError, match=rf"at least {D.min_tokens(1)} tokens \(no --seq-len fits this file\)"):
    D.check_splits(D.split(np.zeros(5, np.uint8)), 1)


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
  "flags, match",
  [
    (["--preset", "gpt-9000"], "invalid choice"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seq-len", "129"], "block size"),
    (["--offload", "none", "--param-dtype", "bfloat16"], "--param-dtype float32"),
    (["--warmup", "10", "--steps", "10"], "--warmup"),
    (["--n-head", "3"], "divisible"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
    (["--offload", "gpu"], "invalid choice"),
    (["--resume", "--overwrite"], "contradict"),
    (["--offload", "none", "--delay", "1"], "--delay 1"),
    (["--resume", "--no-ckpt"], "drop --no-ckpt"),
    (["--write-behind", "--delay", "1"], "--write-behind"),
    (["--delay-predict"], "--delay-predict"),
    (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--grad-accum", "2", "--grad-flush", "all"], "drop --grad-flush all"),
    (["--mesh", "data=2"], "this job has 1"),
    (["--mesh", "dp=1"], "give axis sizes as data=D,fsdp=F"),
    (["--mesh", "data=1,data=1"], "each once"),
    (["--remat", "some"], "invalid choice"),
    (["--arch", "llama", "--preset", "gpt2-124m"], "not a preset of --arch llama"),
    (["--arch", "llama", "--n-head", "2", "--preset", "llama-1.1b"], "multiple of n_kv_head=4"),
  ],
)
def test_bad_flags_are_argparse_errors(flags, match, capsys):
  with pytest.raises(SystemExit) as e:
    F.parse_args(["--d-model", "32", *flags])
  assert e.value.code == 2
  assert match in capsys.readouterr().err


def test_defaults():
  args = F.parse_args([])
  assert (args.preset, args.offload, args.param_dtype) == ("tiny", "auto", "bfloat16")
  assert args.compute_dtype == ("bfloat16" if jax.default_backend() == "gpu" else "float32")
  assert args.seq_len == 128 and args.out == os.path.join("runs", "tiny")
  assert F.parse_args(["--offload", "none"]).param_dtype == "float32"
  assert (args.grad_accum, args.grad_flush) == (1, "host")
  assert F.parse_args(["--grad-accum", "4"]).grad_flush == "none"  # the sum is on the accelerator: nothing to flush
  assert args.mesh is None and F.parse_args(["--mesh", "data=1"]).mesh == {"data": 1, "fsdp": 1}
  assert args.remat == "auto" and F.parse_args(["--remat"]).remat == "full"  # the flag alone: full, as it was
  assert F.parse_args(["--remat", "minimal"]).remat == "minimal"
  assert args.arch == "gpt" and F.parse_args(["--arch", "llama"]).out == os.path.join("runs", "llama-tiny")
  assert F.parse_args(["--arch", "llama", "--preset", "llama-7b"]).out == os.path.join("runs", "llama-7b")


def test_help_shows_only_real_defaults():
  text = F.build_parser().format_help()
  assert "(default: None)" not in text and "(default: False)" not in text
  assert "(default: 500)" in text  # --steps


@pytest.mark.parametrize("columns", ["60", "80", "160"])
def test_help_breaks_lines_between_words_only(columns, monkeypatch):
  monkeypatch.setenv("COLUMNS", columns)  # argparse's width
  parser = F.build_parser()
  text = " ".join(parser.format_help().split())
  for action in parser._actions:
    assert action.help, f"{action.option_strings} has no help"
    assert " ".join(action.help.split()) in text, f"the help of {action.option_strings} is broken inside a word"


def test_help_names_the_optimizer_defaults():
  parser = F.build_parser()
  helps = {a.dest: a.help for a in parser._actions}
  text = " ".join(parser.format_help().split())
  for dest in ("beta1", "beta2", "seed"):
    assert f"{helps[dest]} (default: {parser.get_default(dest)})" in text
  assert "0.999" in helps["beta2"]  # says how it differs from optax's default
  stated = {}
  for item in helps["lr"].split("default by preset: ")[1].split(", "):
    names, value = item.split(" ")
    stated |= dict.fromkeys(names.split("/"), float(value))
  arch = {name: next(a for a, m in F.ARCHS.items() if name in m.PRESETS) for name in F.preset_names()}
  assert stated == {name: F.parse_args(["--arch", arch[name], "--preset", name]).lr for name in arch}


# python -m train.gpt with a stand-in calibration: the notice is due (no cached one) and nothing is measured
# (test_calibration.py tests the measuring).
_STAND_IN_CALIBRATION = textwrap.dedent("""
    import sys
    from jax_dos.planning import calibration
    from train import gpt
    calibration.measure = lambda **kw: calibration.Calibration(1e9, 1e9, 1e9, 5e8, 5e8)
    gpt.main(sys.argv[1:])
""")


def test_progress_off_a_terminal_is_plain_lines_and_the_script_ends_soon_after_its_last_step(tmp_path):
  """The script's output to a pipe: a line per log interval, no carriage returns; jax_dos's notes plain. The
  overlapped step settles and closes with the run: the process ends within seconds of its last line."""
  from jax_dos.planning import calibration

  env = {k: v for k, v in os.environ.items() if k != calibration.ENV_OVERRIDE}
  env |= dict(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "cache"))  # no calibration
  flags = [f for f in TINY if f != "--quiet"]
  argv = [sys.executable, "-c", _STAND_IN_CALIBRATION, *flags, "--steps", "4", "--log-every", "2", "--eval-every", "0",
          "--no-ckpt", "--overlap", "on", "--grad-accum", "2", "--batch", "2", "--clip", "1e-3",
          "--out", str(tmp_path / "run")]  # fmt: skip
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.Popen(argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines, last = [], None
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("done: step 4"):
      last = time.monotonic()
  proc.wait(timeout=300)
  err = "".join(lines)
  assert proc.returncode == 0 and last is not None, err[-3000:]
  assert time.monotonic() - last < 15
  assert "\r" not in err and "WARNING" not in err
  assert "jax_dos: measuring this machine for the performance model (plan='auto'); a few seconds, then cached." in (
    err.splitlines()
  )
  steps = [line.split()[1] for line in err.splitlines() if re.match(r"step \d+/4 \[[\d:]+\] eta .*, loss", line)]
  assert steps == ["2/4", "4/4"], err


def test_library_notes_are_lines_warnings_even_when_quiet(capsys):
  logger = logging.getLogger("jax_dos.planning.calibration")
  try:
    P.show_library_notes(info=True)
    logger.info("a note")
    P.show_library_notes(info=True)  # again: one handler, not two
    logger.info("another note")
    assert capsys.readouterr().err == "a note\nanother note\n"
    P.show_library_notes(info=False)
    logger.info("hidden")
    logger.warning("a problem")
    assert capsys.readouterr().err == "warning: a problem\n"
  finally:
    P.show_library_notes(info=True)


def test_a_terminal_gets_the_bar():
  class Terminal(io.StringIO):
    def isatty(self) -> bool:
      return True

  assert isinstance(P.make_bar(10, file=Terminal()), tqdm.tqdm)
  assert isinstance(P.make_bar(10, file=io.StringIO()), P.PlainProgress)


def test_eta_waits_for_a_step_after_compilation():
  eta = P.Eta(total=100)
  assert eta.text(1, 50.0) == "--"  # the first step compiled: no estimate from it
  eta.start(1, 50.0)
  assert eta.text(1, 50.0) == "--"
  assert eta.seconds(11, 60.0) == pytest.approx(89.0)  # 1 s a step since the first step, 89 steps left
  assert eta.text(11, 60.0) == "1:29" and P.fmt_duration(3725) == "1:02:05"


def test_weight_decay_mask_skips_vectors():
  mask = O.decay_mask({"w": np.zeros((2, 3)), "b": np.zeros(3), "emb": {"e": np.zeros((4, 2))}, "s": np.zeros(())})
  assert mask == {"w": True, "b": False, "emb": {"e": True}, "s": False}


# ----------------------------------------------------------------------------- training runs


def test_training_loss_falls_and_logs(tmp_path):
  out = _run(tmp_path, "run", "--steps", "30", "--lr", "1e-2", "--eval-every", "15", "--log-every", "5", "--plot")
  losses = [out["losses"][s] for s in sorted(out["losses"])]
  assert len(losses) == 30 and out["step"] == 30
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, losses
  assert sorted(out["val_losses"]) == [0, 15, 30] and out["val_losses"][30] < out["val_losses"][0]
  assert out["tokens_per_s"] > 0 and "host" in out["plan"]
  if jax.default_backend() == "cpu":  # no accelerator: --offload auto streams nothing, and the plan does not say stream
    assert "stream" not in out["plan"], out["plan"]
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))
  assert {"step", "loss", "val_loss", "lr", "tokens_per_s", "mfu", "time"} <= set(rows[-1])
  png = tmp_path / "run" / "loss.png"
  drawn = png.read_bytes()
  png.unlink()  # python -m train.plot draws the same from the log alone
  assert plot.main([str(tmp_path / "run"), "--title", "tiny, offload auto"]) == str(png)
  assert png.read_bytes() == drawn


def test_plot_errors_say_what_to_do(tmp_path, monkeypatch, capsys):
  with pytest.raises(SystemExit, match="no losses to plot"):
    plot.main([str(tmp_path)])
  log = P.MetricsLog(str(tmp_path / "metrics.jsonl"))
  log.write({"step": 1, "loss": 5.0})
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
  with pytest.raises(SystemExit, match=re.escape("pip install -e '.[plot]'")):
    plot.main([str(tmp_path)])
  with pytest.raises(SystemExit):
    F.parse_args(["--plot"])  # refused before training, naming the same command
  assert "pip install -e '.[plot]'" in capsys.readouterr().err
  assert not (tmp_path / "loss.png").exists()


def test_offload_none_and_host_give_the_same_loss_curve(tmp_path):
  common = ["--steps", "4", "--lr", "3e-3", "--warmup", "1", "--eval-every", "0", "--log-every", "1",
            "--param-dtype", "float32"]  # fmt: skip
  ref = _run(tmp_path, "none", *common, "--offload", "none")
  for mode in ("host", "stream", "host --grad-flush none", "auto --grad-flush all"):
    got = _run(tmp_path, mode.replace(" ", ""), *common, "--offload", *mode.split())
    np.testing.assert_allclose(list(got["losses"].values()), list(ref["losses"].values()), rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_accumulated_micro_batches_train_like_one_batch(tmp_path):
  """``--batch 2 --grad-accum 2`` trains on the same rows as ``--batch 4``: same losses, same weights."""
  common = ["--steps", "3", "--lr", "3e-3", "--warmup", "1", "--eval-every", "0", "--log-every", "1",
            "--param-dtype", "float32", "--offload", "host"]  # fmt: skip
  with jax.default_matmul_precision("highest"):  # on a GPU: no TF32 (the split changes the products' rounding)
    ref = _run(tmp_path, "one", *common, "--compute-dtype", "float32")
    got = _run(tmp_path, "accum", *common, "--compute-dtype", "float32", "--batch", "2", "--grad-accum", "2")
  np.testing.assert_allclose(list(got["losses"].values()), list(ref["losses"].values()), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got["params"]), jax.tree.leaves(ref["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags", [["--grad-flush", "none"], ["--grad-accum", "2"]])
def test_the_loop_holds_no_gradients_while_the_next_step_computes(tmp_path, monkeypatch, flags):
  """Gradients left on the accelerator are freed after the update: the planner counts them through it only.

  (At 6.7B the loop's reference to the last step's 12 GiB of gradients ran the next update out of GPU memory.)
  """
  make_grad_step, alive = T.make_grad_step, []

  def watched(*args, **kwargs):
    grad_step = make_grad_step(*args, **kwargs)

    def step(*a):
      gc.collect()
      alive.append(sum(r() is not None for r in refs) if (refs := getattr(step, "refs", None)) else 0)
      loss, grads, scale, norm = grad_step(*a)
      step.refs = [weakref.ref(g) for g in jax.tree.leaves(grads)]
      return loss, grads, scale, norm

    return step

  monkeypatch.setattr(T, "make_grad_step", watched)
  _run(tmp_path, "run", "--steps", "3", "--eval-every", "0", "--offload", "host", *flags)
  assert alive == [0, 0, 0]


@pytest.mark.parametrize("clip", [0.0, 1.0, 1e-3])
def test_accumulated_gradient_is_the_batch_gradient(clip):
  """``scale * grad_sum`` over micro-batches is the whole batch's gradient times its clip factor."""
  cfg = gpt_model.get_config("tiny", n_layer=2, d_model=32, n_head=2, vocab_size=256, block_size=32, dtype="float32")
  graphdef, params = gpt_model.init_params(cfg, seed=int(np.random.default_rng().integers(1000)))
  rng = np.random.default_rng()
  batch = tuple(rng.integers(0, 256, (6, 32)).astype(np.int32) for _ in range(2))
  with jax.default_matmul_precision("highest"):
    loss, grads, scale, norm = G.make_grad_step(None, params)(graphdef, params, batch, clip)
    loss3, sums, scale3, norm3 = G.make_grad_step(None, params, micro_batches=3)(graphdef, params, batch, clip)
  np.testing.assert_allclose(float(loss3), float(loss), rtol=1e-6)
  np.testing.assert_allclose(float(norm3), float(optax.global_norm(grads)), rtol=1e-5)  # the mean gradient's norm
  np.testing.assert_allclose(float(norm), float(optax.global_norm(grads)), rtol=1e-6)
  for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(sums)):
    want = np.asarray(g) * float(scale)  # float32 sums in another order: rounding relative to the leaf's scale
    np.testing.assert_allclose(np.asarray(s) * float(scale3), want, rtol=2e-5, atol=2e-6 * np.abs(want).max())
  with pytest.raises(ValueError, match="equal micro-batches"):
    G.make_grad_step(None, params, micro_batches=4)(graphdef, params, batch, clip)


def test_accumulation_needs_one_micro_batch_of_activations():
  """The planner's step memory for 4 micro-batches: one micro-batch's program plus the running sum, kept live."""
  cfg = gpt_model.get_config("tiny", n_layer=2, d_model=32, n_head=2, vocab_size=256, block_size=64)
  graphdef, params = gpt_model.init_params(cfg)
  grads = sum(x.nbytes for x in jax.tree.leaves(params))
  whole = G.gradient_step_memory(graphdef, params, (32, 64), 1.0, "none")
  micro = G.gradient_step_memory(graphdef, params, (32, 64), 1.0, "none", micro_batches=4)
  quarter = G.gradient_step_memory(graphdef, params, (8, 64), 1.0, "none")
  assert micro.live_bytes >= grads
  assert micro.peak_bytes < whole.peak_bytes
  assert micro.peak_bytes < quarter.peak_bytes + grads // 2  # no second copy of the gradients


def test_write_behind_trains_bit_identically(tmp_path):
  """--write-behind only moves the host state's writes behind the next step: same losses, same parameters."""
  common = ["--steps", "4", "--warmup", "1", "--eval-every", "0", "--log-every", "1", "--offload", "host", "--no-ckpt"]
  plain = _run(tmp_path, "plain", *common)
  behind = _run(tmp_path, "behind", *common, "--write-behind")
  assert behind["losses"] == plain["losses"]
  assert _same_tree(behind["params"], plain["params"])


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.parametrize(
  "offload",
  [
    "host",
    "none",
    "host --delay 1 --delay-warmup 1",
    "host --delay 1 --delay-warmup 1 --delay-predict",
    "host --delay 1 --delay-warmup 1 --delay-predict gradient",
    "host --delay 1 --delay-warmup 1 --delay-predict gradient --batch 2 --grad-accum 2",
    "auto --overlap on --batch 2 --grad-accum 2",
  ],
)
def test_resume_is_bit_exact(tmp_path, offload):
  # One run of 2N steps vs N steps + resume for N more, with the same schedule horizon (--decay-steps).
  schedule = ["--decay-steps", "6", "--warmup", "2"]
  common = ["--offload", *offload.split(), *schedule, "--eval-every", "3", "--log-every", "1"]
  full = _run(tmp_path, "full", *common, "--steps", "6", "--ckpt-every", "2")
  first = _run(tmp_path, "split", *common, "--steps", "3")
  second = _run(tmp_path, "split", *common, "--steps", "6", "--resume")
  assert second["start_step"] == 3 and second["step"] == 6
  assert _same_tree(full["params"], second["params"])
  assert {**first["losses"], **second["losses"]} == full["losses"]
  assert second["val_losses"] == {s: v for s, v in full["val_losses"].items() if s > 3}
  # The metrics log of the split run reads as one run, identical to the full run's losses.
  rows = lambda name: [
    (r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(tmp_path / name / "metrics.jsonl"))
  ]  # noqa: E731
  assert rows("split") == rows("full")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_resume_with_more_steps_keeps_the_learning_rate_schedule(tmp_path):
  common = ["--offload", "host", "--eval-every", "0", "--log-every", "1"]
  _run(tmp_path, "split", *common, "--lr", "1e-2", "--warmup", "1", "--steps", "4")
  resumed = _run(tmp_path, "split", *common, "--steps", "8", "--resume")  # no schedule flags: the first run's
  rows = P.read_metrics(str(tmp_path / "split" / "metrics.jsonl"))
  first = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 4, 1e-3)  # --decay-steps defaulted to the first --steps
  assert [r["step"] for r in rows] == list(range(1, 9))
  np.testing.assert_allclose([r["lr"] for r in rows], [float(first(r["step"] - 1)) for r in rows], rtol=1e-6)
  # The optimizer steps on that schedule too: the same parameters as one run told it explicitly.
  whole = _run(tmp_path, "whole", *common, "--lr", "1e-2", "--warmup", "1", "--decay-steps", "4", "--steps", "8")
  assert resumed["losses"] == {s: v for s, v in whole["losses"].items() if s > 4}
  assert _same_tree(resumed["params"], whole["params"])


def test_resumed_schedule_takes_the_flags_not_given():
  saved = vars(F.parse_args(["--steps", "10", "--warmup", "3", "--lr", "1e-2"]))
  args = F.parse_args(["--steps", "20"])
  notes = F.resumed_schedule(args, saved)
  assert len(notes) == 1 and "--decay-steps" in notes[0] and "--warmup" in notes[0]
  assert [getattr(args, k) for k in F.SCHEDULE_FLAGS] == [saved[k] for k in F.SCHEDULE_FLAGS]
  args = F.parse_args(["--steps", "20", "--decay-steps", "20", "--lr", "1e-3"])  # given: honoured
  F.resumed_schedule(args, saved)
  assert (args.decay_steps, args.lr, args.min_lr, args.warmup) == (20, 1e-3, 1e-3 / 10, saved["warmup"])
  same = F.parse_args(["--steps", "10", "--warmup", "3", "--lr", "1e-2", "--resume"])
  assert F.resumed_schedule(same, saved) == []
  with pytest.raises(SystemExit, match="--warmup"):  # the saved warm-up does not fit the given decay
    F.resumed_schedule(F.parse_args(["--decay-steps", "3"]), saved)


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_overlapped_step_trains_and_its_checkpoint_resumes_on_the_plain_path(tmp_path):
  overlapped = _run(tmp_path, "run", "--steps", "4", "--overlap", "on", "--eval-every", "0", "--log-every", "1")
  assert overlapped["plan"].startswith(("Plan (model+timeline)", "Plan (model+stages)"))
  assert list(overlapped["losses"]) == [1, 2, 3, 4] and all(math.isfinite(v) for v in overlapped["losses"].values())
  plain = _run(tmp_path, "run", "--steps", "5", "--overlap", "off", "--resume", "--eval-every", "0")
  assert plain["start_step"] == 4 and plain["plan"].startswith("Plan (model)")
  with pytest.raises(SystemExit):
    _run(tmp_path, "bad", "--overlap", "on", "--delay", "1")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_checkpoint_directory_guards(tmp_path, capsys):
  with pytest.raises(SystemExit, match="no checkpoint"):
    _run(tmp_path, "fresh", "--steps", "1", "--resume")
  _run(tmp_path, "run", "--steps", "1", "--eval-every", "0")
  with pytest.raises(SystemExit, match="--resume to continue it, --overwrite to start again, --no-ckpt"):
    _run(tmp_path, "run", "--steps", "2")
  with pytest.raises(SystemExit, match="not found"):  # other mistakes are not hidden by the refusal
    _run(tmp_path, "run", "--steps", "2", "--data", str(tmp_path / "missing.txt"))
  out = _run(tmp_path, "run", "--steps", "2", "--eval-every", "0", "--no-ckpt")  # a second run that saves nothing
  assert out["step"] == 2 and "leaves the checkpoints" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="model differs"):
    _run(tmp_path, "run", "--steps", "2", "--resume", "--d-model", "64")
  with pytest.raises(SystemExit, match="not found"):  # a failed --overwrite deletes nothing
    _run(tmp_path, "run", "--steps", "2", "--overwrite", "--data", str(tmp_path / "missing.txt"))
  assert os.listdir(tmp_path / "run" / "ckpt") == ["1"]
  _run(tmp_path, "run", "--steps", "2", "--overwrite", "--eval-every", "0")
  assert os.listdir(tmp_path / "run" / "ckpt") == ["2"]


# Damage done to the newest checkpoint of a run (tests/test_checkpoint.py damages files the same ways).
def _damage_newest(ckpt: str, kind: str) -> None:
  step_dir = os.path.join(ckpt, str(max(int(n) for n in os.listdir(ckpt) if n.isdigit())))
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if f != "jax_dos_manifest.json"]
  largest = max(files, key=os.path.getsize)
  rng = np.random.default_rng()
  if kind == "truncated":
    with open(largest, "r+b") as f:
      f.truncate(os.path.getsize(largest) // 2)
  elif kind == "bit_flipped_in_metadata":
    path = os.path.join(step_dir, "params", "_METADATA")
    data = bytearray(open(path, "rb").read())
    data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    open(path, "wb").write(bytes(data))
  elif kind == "master_removed":
    shutil.rmtree(os.path.join(step_dir, "master"))
  elif kind == "4k_overwritten":
    size = os.path.getsize(largest)
    with open(largest, "r+b") as f:
      f.seek(size // 2)
      f.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
  elif kind == "manifest_missing":
    os.remove(os.path.join(step_dir, "jax_dos_manifest.json"))


RECOVERY = ["--offload", "host", "--decay-steps", "8", "--warmup", "2", "--eval-every", "0", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def recovery_runs(tmp_path_factory):
  """An undamaged run of 8 steps, and a run stopped at step 4 (checkpoints 2 and 4), to be damaged and resumed."""
  root = tmp_path_factory.mktemp("recovery")
  full = _run(root, "full", *RECOVERY, "--steps", "8")
  _run(root, "stopped", *RECOVERY, "--steps", "4")
  return root, full["losses"]


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.xdist_group("recovery_runs")  # one worker makes the module's runs
@pytest.mark.parametrize(
  "kind", ["truncated", "bit_flipped_in_metadata", "master_removed", "4k_overwritten", "manifest_missing"]
)
def test_resume_survives_a_damaged_newest_checkpoint(tmp_path, recovery_runs, kind, capsys):
  root, full = recovery_runs
  shutil.copytree(root / "stopped", tmp_path / "run")
  ckpt = tmp_path / "run" / "ckpt"
  _damage_newest(str(ckpt), kind)
  capsys.readouterr()
  out = _run(tmp_path, "run", *RECOVERY, "--steps", "6", "--resume")
  lines = [line for line in capsys.readouterr().err.splitlines() if "failed verification" in line]
  assert len(lines) == 1 and "step 4" in lines[0] and "moved to" in lines[0], lines
  assert out["start_step"] == 2 and out["step"] == 6
  assert out["losses"] == {s: v for s, v in full.items() if 2 < s <= 6}  # the undamaged run's, bit for bit
  assert len(os.listdir(ckpt / "damaged")) == 1 and os.listdir(ckpt / "damaged")[0].startswith("4-")
  assert sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) == [2, 4, 6]  # step 2 kept, 4 written again
  again = _run(tmp_path, "run", *RECOVERY, "--steps", "8", "--resume")
  assert again["start_step"] == 6 and again["losses"] == {s: v for s, v in full.items() if s > 6}


_KILLED_FIRST_SAVE = textwrap.dedent("""
    import os, signal, sys
    from jax_dos import checkpoint_integrity
    from train import gpt
    # SIGKILL once Orbax has committed the first checkpoint, before its manifest is written.
    checkpoint_integrity.write_manifest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    gpt.main(sys.argv[1:])
""")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_a_first_save_killed_midway_is_taken_over_by_a_plain_run_and_by_resume(tmp_path, capsys):
  flags = [*TINY, "--offload", "host", "--eval-every", "0", "--ckpt-every", "2", "--steps", "3"]
  proc = subprocess.run(
    [sys.executable, "-c", _KILLED_FIRST_SAVE, *flags, "--out", str(tmp_path / "a")],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])),
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert os.listdir(tmp_path / "a" / "ckpt") == ["2"]  # committed, no manifest
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  for name, extra in (("a", []), ("b", ["--resume"])):
    capsys.readouterr()
    out = _run(tmp_path, name, *flags[len(TINY) :], *extra)
    err = capsys.readouterr().err
    assert out["start_step"] == 0 and out["step"] == 3, name
    assert "no complete checkpoint" in err and "2-no-manifest" in err, err
    assert sorted(os.listdir(tmp_path / name / "ckpt")) == ["2", "3", "damaged"]


DIVERGING = ["--offload", "host", "--decay-steps", "100", "--warmup", "0", "--eval-every", "0", "--log-every", "10"]


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
  """A run of 4 steps with checkpoints at steps 2 and 4, to be copied and resumed with a diverging learning rate."""
  root = tmp_path_factory.mktemp("diverging")
  _run(root, "run", *DIVERGING, "--steps", "4", "--ckpt-every", "2")
  return root / "run"


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.xdist_group("checkpointed_run")  # one worker makes the module's run
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the learning rate, in float32
@pytest.mark.parametrize("ckpt_every, match", [("1", "parameters after step 5's update are not finite"),
                                               ("4", "training loss of step 6 is nan")])  # fmt: skip
def test_a_diverging_run_stops_and_saves_nothing(tmp_path, checkpointed_run, ckpt_every, match):
  common = DIVERGING
  shutil.copytree(checkpointed_run, tmp_path / "run")
  before = {n: os.path.getmtime(tmp_path / "run" / "ckpt" / n) for n in os.listdir(tmp_path / "run" / "ckpt")}
  with pytest.raises(SystemExit, match=match) as e:  # an overflowing learning rate: inf parameters after step 5
    _run(tmp_path, "run", *common, "--steps", "12", "--ckpt-every", ckpt_every, "--resume", "--lr", "1e39")
  assert "Nothing of this state was saved; the newest checkpoint is step 4" in str(e.value)
  after = {n: os.path.getmtime(tmp_path / "run" / "ckpt" / n) for n in os.listdir(tmp_path / "run" / "ckpt")}
  assert after == before  # nothing written, nothing deleted
  assert _run(tmp_path, "run", *common, "--steps", "6", "--resume")["start_step"] == 4


def test_no_ckpt_writes_no_checkpoint(tmp_path):
  _run(tmp_path, "nockpt", "--steps", "2", "--eval-every", "0", "--no-ckpt")
  ckpt = tmp_path / "nockpt" / "ckpt"
  assert not ckpt.exists() or not any(ckpt.iterdir())


def test_budget_flags_reach_the_planner(tmp_path):
  # No accelerator memory for resident or streamed state: the performance model can only choose the host.
  out = _run(tmp_path, "budget", "--steps", "2", "--eval-every", "0", "--offload", "auto", "--resident-gb", "0",
             "--staging-gb", "0")  # fmt: skip
  assert "host:    1 subgroups" in out["plan"] and "(100.0%)" in out["plan"].split("host:")[1], out["plan"]


@pytest.mark.parametrize("flush", ["all", "host", "none"])
def test_gradient_step_memory_counts_the_compiled_step(flush):
  cfg = gpt_model.get_config("tiny", n_layer=1, d_model=32, n_head=2, vocab_size=256, block_size=32)
  graphdef, params = gpt_model.init_params(cfg)
  need = G.gradient_step_memory(graphdef, params, (4, 32), 1.0, flush)
  grads = sum(x.nbytes for x in jax.tree.leaves(params))
  assert 0 < need.live_bytes <= need.peak_bytes  # the loss and the clip's scale stay on the accelerator
  all_host = G.gradient_step_memory(graphdef, params, (4, 32), 1.0, "all")
  if flush == "host":  # some gradients stay on the accelerator: every one counted as live (an upper bound)
    assert need == type(need)(all_host.peak_bytes + grads, all_host.live_bytes + grads)
  if flush == "none":  # its own program: every gradient is an output on the accelerator
    assert need.live_bytes >= grads


def test_a_split_flush_larger_than_its_budget_is_refused():
  """The split program's own memory is checked against what the plan assumed (CPU programs have a real analysis)."""
  cfg = gpt_model.get_config("tiny", n_layer=1, d_model=32, n_head=2, vocab_size=256, block_size=32)
  graphdef, params = gpt_model.init_params(cfg)
  batch = (jax.ShapeDtypeStruct((4, 32), np.int32),) * 2
  leaves = len(jax.tree.leaves(params))
  tx = T.jax_dos.interleaved_adam(1e-3, plan=["host", "device"] * (leaves // 2) + ["host"] * (leaves % 2),
                                  subgroup_size=1)  # fmt: skip
  compiled = G.make_grad_step(tx, params, "host").lower(graphdef, params, batch, 1.0).compile()
  need = T.jax_dos.StepMemory.of(compiled)
  G.check_split_flush(compiled, need)  # exactly what it needs: accepted
  with pytest.raises(SystemExit, match="--grad-flush all"):
    G.check_split_flush(compiled, T.jax_dos.StepMemory(need.peak_bytes - 1, min(need.live_bytes, need.peak_bytes - 1)))


# ----------------------------------------------------------------------------- the step: chosen, one interface


def _plan(placements: int, predicted: dict) -> T.jax_dos.Plan:
  return T.jax_dos.Plan(((0,),) * placements, ("host",) * placements, (1,) * placements, 2, predicted)


@pytest.mark.parametrize(
  "mode, overlapped, plain, refusal, chosen",
  [
    ("auto", {"step": 2.9, "exposed": 0.1}, {"total": 0.9}, None, True),  # 2.9 s against 2.8 + 0.9 s
    ("auto", {"step": 3.9, "exposed": 1.1}, {"total": 0.9}, None, False),  # 3.9 s against 2.8 + 0.9 s
    ("auto", {"step": 2.9, "exposed": 0.1, "step_clip_fired": 3.5}, {"total": 0.9}, None, True),
    ("auto", {"step": 2.9, "exposed": 0.1, "step_clip_fired": 3.9}, {"total": 0.9}, None, False),  # slower fired
    ("auto", {}, {"total": 0.9}, None, False),  # no timeline: nothing to compare
    ("auto", {"step": 2.9, "exposed": 0.1}, {"total": 0.9}, "--delay 1 is a mode of the plain path", False),
    ("on", {}, {}, None, True),
    ("off", {"step": 2.9, "exposed": 0.1}, {"total": 0.9}, None, False),
  ],
)
def test_the_step_is_chosen_by_the_plans_predictions(mode, overlapped, plain, refusal, chosen):
  got, line = S.choose(mode, _plan(2, plain), _plan(2, overlapped), refusal)
  assert got == chosen and line.startswith("step    " + ("overlapped" if chosen else "plain"))
  if overlapped and plain and refusal is None:
    assert f"overlapped {overlapped['step']:.2f} s" in line  # each step's prediction is said
    assert f"plain {overlapped['step'] - overlapped['exposed'] + plain['total']:.2f} s" in line


def test_the_line_says_which_rematerialisation_the_overlapped_plan_chose():
  remat = ("full", "minimal", "minimal", "full")
  overlapped = dataclasses.replace(_plan(2, {"step": 2.9, "exposed": 0.1}), remat=remat)
  _, line = S.choose("auto", _plan(2, {"total": 0.9}), overlapped, None)
  assert "overlapped 2.90 s, remat minimal on 2 of 4 stages, full on 2" in line
  _, line = S.choose("auto", _plan(2, {"total": 0.9}), _plan(2, {"step": 2.9, "exposed": 0.1}), None)
  assert "remat" not in line  # the stages' own policies: nothing chosen


def test_the_choice_from_plans_made_for_a_given_device_memory():
  """With the device's memory given to the planner (no GPU), both plans come from shapes before any state exists; an
  accelerator too small for the state makes the overlapped step win, hiding the host update under the backward pass."""
  cfg = gpt_model.get_config("tiny", n_layer=2, d_model=128, n_head=2, vocab_size=256, block_size=32)
  _, params = gpt_model.init_params(cfg)
  cal = T.jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9, device_free_bytes=2**20)
  planner = T.jax_dos.auto_planner(cal, resident_budget_bytes=0, staging_budget_bytes=0)
  tx = T.jax_dos.interleaved_adam(1e-3, planner=planner)
  plain = T.jax_dos.get_plan(tx, params)
  n = cfg.n_layer + 2
  times = T.jax_dos.StageTimes((0.01,) * n, (0.02,) * n)
  staged = gpt_model.staged(cfg)
  overlapped = T.jax_dos.overlapped_plan(tx, staged.stages, staged.split(params), stage_times=times, micro_batches=2)
  assert set(plain.placements) == {"host"} and plain.predicted["total"] > 0
  assert overlapped.predicted["step"] < times.compute_s(2) + plain.predicted["total"]
  chosen, line = S.choose("auto", plain, overlapped, None)
  assert chosen and "predicted step: overlapped" in line


@pytest.mark.parametrize(
  "clip, model",
  [("1e-3", []), ("1e3", []), ("1e-3", ["--arch", "llama", "--n-head", "4"])],  # llama: 4 heads over its 2 kv heads
  ids=["clip_fires", "clip_silent", "llama_clip_fires"],
)
def test_the_overlapped_steps_losses_and_norms_equal_the_plain_steps(tmp_path, clip, model):
  """One interface, two steps: the same losses and gradient norms, every step's norm and clip in the log; under
  --remat auto (the plain step keeps every activation on the CPU, the overlapped one recomputes every stage) and
  --remat minimal (both keep the large matmuls' outputs). The Llama-style model's stages come from its own modules
  as the GPT's do (``jax_dos.nnx_stages``)."""
  remat = "minimal" if clip == "1e-3" else "auto"
  common = ["--steps", "4", "--eval-every", "0", "--log-every", "2", "--param-dtype", "float32", "--batch", "2",
            "--grad-accum", "2", "--clip", clip, "--offload", "host", "--remat", remat, *model]  # fmt: skip
  runs = {mode: _run(tmp_path, mode, *common, "--overlap", mode) for mode in ("on", "off")}
  assert runs["on"]["plan"] != runs["off"]["plan"]  # the overlapped step's plan, said as the one in use
  for key in ("losses", "grad_norms"):
    np.testing.assert_allclose(list(runs["on"][key].values()), list(runs["off"][key].values()), rtol=2e-5)
  for mode, out in runs.items():
    rows = [json.loads(line) for line in open(tmp_path / mode / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["clipped"] == (r["grad_norm"] >= float(clip)) for r in steps)
    assert out["clip_fired"] == sum(r["clipped"] for r in steps) == (4 if clip == "1e-3" else 0)


def test_slow_setup_phases_say_where_the_time_goes(tmp_path, monkeypatch, capsys):
  """Before a large model's first step a GPU spends minutes compiling, measuring and allocating: each phase that takes
  ``SLOW_SETUP_S`` says so as it ends (here every phase, the threshold at 0)."""
  monkeypatch.setattr(T, "SLOW_SETUP_S", 0.0)
  flags = [f for f in TINY if f != "--quiet"]
  T.main([*flags, "--out", str(tmp_path / "run"), "--steps", "1", "--eval-every", "0", "--no-ckpt"])
  err = capsys.readouterr().err
  assert "setup   the parameters initialised (" in err
  assert "setup   the optimizer state allocated in the plain step's placements (" in err
  assert err.index("setup   the parameters initialised") < err.index("model   gpt")
