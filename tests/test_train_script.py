"""train/: the training script as a user meets it: the data it reads, its flags and help, what it prints while it
runs, and the log, metrics and plot a run leaves."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import tqdm
from helpers import TINY
from helpers import train_tiny as _run

from train import calibration as C
from train import data as D
from train import flags as F
from train import gpt as T
from train import parallel as M
from train import plot
from train import progress as P
from train import schedule as S

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
    (["--warmup", "-1"], "--warmup"),
    (["--n-head", "3"], "divisible"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
    (["--offload", "gpu"], "invalid choice"),
    (["--resume", "--overwrite"], "contradict"),
    (["--offload", "none", "--delay", "1"], "--delay 1"),
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
    (["--profile", "6"], "give FIRST:STOP"),
    (["--profile", "1:3"], "step 1 compiles"),
    (["--profile", "5:5"], "2 <= FIRST < STOP"),
    (["--steps", "4", "--profile", "3:9"], "--steps + 1 = 5"),
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


def test_the_config_is_frozen_one_field_a_flag_and_json():
  """``parse_args`` gives a frozen :class:`TrainConfig`, a typed field for each flag (and each derived value), every
  default resolved; its ``asdict`` is JSON (a checkpoint's meta saves it as ``args``)."""
  args = F.parse_args(["--steps", "20", "--profile", "3:5"])
  assert isinstance(args, F.TrainConfig)
  with pytest.raises(dataclasses.FrozenInstanceError):
    args.lr = 1.0
  with pytest.raises(dataclasses.FrozenInstanceError):
    del args.steps
  fields = {f.name for f in dataclasses.fields(F.TrainConfig)}
  assert {a.dest for a in F.build_parser()._actions if a.dest != "help"} <= fields
  assert {"schedule_given", "mesh_given", "global_batch"} <= fields
  assert args.lr == S.DEFAULT_LR["tiny"] and args.warmup == 2 and args.min_lr == args.lr / 10
  assert args.profile == (3, 5) and args.schedule_given == () and args.global_batch == args.batch
  saved = json.loads(json.dumps(dataclasses.asdict(args)))
  assert saved == {**dataclasses.asdict(args), "profile": [3, 5], "schedule_given": []}


def test_main_parses_argv_once(tmp_path, monkeypatch):
  """``train.gpt.main`` parses its command line once (what it sets before jax starts comes from that parse), and the
  checkpoint's meta saves that config."""
  import jax_dos

  parsed = []
  parse = argparse.ArgumentParser.parse_known_args

  def counted(self, *a, **kw):
    parsed.append(self.prog)
    return parse(self, *a, **kw)

  monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", counted)
  flags = ["--steps", "2", "--eval-every", "0"]
  result = _run(tmp_path, "run", *flags)
  assert result["step"] == 2 and parsed.count("python -m train.gpt") == 1
  with jax_dos.CheckpointManager(str(tmp_path / "run" / "ckpt")) as manager:
    saved = manager.meta()["args"]
  args = F.parse_args([*TINY, "--out", str(tmp_path / "run"), *flags])
  assert saved == json.loads(json.dumps(dataclasses.asdict(args)))


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


def test_the_calibration_is_measured_apart_before_the_gpu_client_starts(tmp_path, monkeypatch, capsys):
  """On a GPU machine with nothing cached, ``train.gpt`` measures the planner's calibration in a process of its own
  before its own GPU client starts (its pinned memory then goes back with that process); here on the CPU, made to
  believe it is on a GPU: the child measures and caches, and nothing runs again once an accelerator's is cached."""
  import dataclasses
  import socket

  import jax_dos
  from jax_dos.planning import calibration, cost_model

  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  monkeypatch.delenv("JAX_DOS_CALIBRATION", raising=False)
  args = F.parse_args([])
  assert not C.measure_apart(args, gpu=False)  # no GPU here: nothing to do
  assert C.measure_apart(args, gpu=True)
  assert "in a process of its own" in capsys.readouterr().out
  assert calibration.load_cached() is not None  # the child's (on the CPU backend here)
  key = cost_model.calibration_key("gpu", "Some GPU", socket.gethostname(), jax.__version__)
  calibration.save(dataclasses.replace(calibration.load_cached(), platform="gpu", device_kind="Some GPU"))
  assert calibration.cache_path(key).exists() and jax_dos.accelerator_calibration_cached()
  assert not C.measure_apart(args, gpu=True)  # cached: no child
  assert not C.measure_apart(F.parse_args(["--offload", "host"]), gpu=True)


def test_the_processes_of_one_host_measure_one_calibration(tmp_path):
  """A job's processes on one host (one per GPU) each call ``measure_apart`` before their GPU clients start: one
  measures in a child and caches it, the others wait for its lock and read the cache (here on the CPU, made to
  believe it is on a GPU, the child's CPU calibration renamed as an accelerator's by the first process)."""
  code = textwrap.dedent(
    """
      import dataclasses
      from jax_dos.planning import calibration
      from train import calibration as C, flags as F
      child = C._measure_in_child
      def measure_as_a_gpu(args):  # the child caches the CPU's calibration: name it an accelerator's, as a GPU's is
          ok = child(args)
          calibration.save(dataclasses.replace(calibration.load_cached(), platform="gpu", device_kind="Some GPU"))
          return ok
      C._measure_in_child = measure_as_a_gpu
      F.parse_args(["--quiet"], lambda flags: print("measured" if C.measure_apart(flags, gpu=True) else "read"))
    """
  )
  env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path), JAX_PLATFORMS="cpu")
  env.pop("JAX_DOS_CALIBRATION", None)
  root = Path(__file__).resolve().parents[1]
  env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
  procs = [subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE, text=True)
           for _ in range(2)]  # fmt: skip
  said = sorted(p.communicate(timeout=300)[0].split()[-1] for p in procs)
  assert said == ["measured", "read"], said


def test_a_profile_of_the_steps_asked_for_and_its_summary(tmp_path):
  """``--profile 2:4`` traces steps 2 and 3 (jax.profiler, with a Perfetto trace, and jax_dos's host spans), and the
  summary script reads it: the CPU's rows and the gradient programs' names."""
  _run(tmp_path, "run", "--steps", "4", "--profile", "2:4")
  traces = list((tmp_path / "run" / "profile").rglob("*.trace.json.gz"))
  assert len(traces) == 1 and list((tmp_path / "run" / "profile").rglob("perfetto_trace.json.gz"))
  spans = json.loads((tmp_path / "run" / "profile" / "spans.json").read_text())
  assert spans["steps"] == [2, 4] and spans["totals"]["wall"]["seconds"] > 0, spans["totals"]
  assert all(0 <= s["start"] <= s["end"] for s in spans["spans"])
  root = Path(__file__).resolve().parents[1]
  out = subprocess.run([sys.executable, "bench/probes/trace_summary.py", str(tmp_path / "run" / "profile"), "--host",
                        "--json", str(tmp_path / "summary.json")], cwd=root, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
  assert out.returncode == 0, out.stderr
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["span_s"] > 0 and "/host:CPU" in summary["devices"], summary.keys()
  rows = summary["devices"]["/host:CPU"].values()
  assert any(r["busy_s"] > 0 and r["events"] > 0 for r in rows)


def test_warm_up_by_model_size_and_a_run_shorter_than_it_ends_rising():
  small = F.parse_args(["--steps", "500"])
  assert (small.warmup, small.decay_steps) == (50, 500)  # min(100, steps / 10) under a billion parameters
  large = F.parse_args(["--preset", "gpt-6.7b", "--steps", "25"])
  assert large.warmup == S.LARGE_WARMUP and large.lr == S.DEFAULT_LR["gpt-6.7b"]
  rates = [float(S.Schedule(large)(i)) for i in range(25)]
  np.testing.assert_allclose(rates, [large.lr * i / S.LARGE_WARMUP for i in range(25)], rtol=1e-4)  # still rising
  given = F.parse_args(["--preset", "gpt-6.7b", "--steps", "25", "--warmup", "5"])
  assert given.warmup == 5 and float(S.Schedule(given)(5)) == pytest.approx(given.lr)  # the flag wins; then cosine
  assert float(S.Schedule(given)(24)) < given.lr
  with pytest.raises(SystemExit):
    F.parse_args(["--warmup", "-1"])
