"""Live against transformers 5's PyTorch models (skipped where torch or transformers 5 is missing: CI has neither;
``tests/test_hf5.py`` compares against what they computed, committed). For each family of
``tests/fixtures/hf5/make_fixtures.py`` (Llama 3, Llama 3.2, Mistral, Qwen2, Qwen3), a checkpoint that transformers 5
writes with ``save_pretrained`` loads with its logits; ``models.hf.save``'s folder loads in transformers 5 with ours;
``train.gpt --init-from`` fine-tunes it on prompt/completion rows and transformers 5 loads ``train.export``'s folder
with the trained model's logits. On a machine with a GPU, an export runs beside a training run that holds the GPU.

    JAX_PLATFORMS=cpu python -m pytest -p no:xdist tests/test_hf5_live.py -v

The comparisons run on jax's CPU backend and torch's CPU, in float32 (a GPU's float32 matmuls may round through
TF32); the GPU test starts its own processes, on the GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
  pytest.skip(f"transformers {transformers.__version__}: these tests are of transformers 5", allow_module_level=True)

from test_fine_tune import sentence, write_tokenizer  # noqa: E402

from models import hf  # noqa: E402
from train import export as E  # noqa: E402
from train import gpt as T  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "hf5"
sys.path.insert(0, str(FIXTURES))
import make_fixtures  # noqa: E402

FAMILIES = list(make_fixtures.FAMILIES)
TOL = 1e-5


def assert_close(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
  """Within :data:`TOL` of the reference's scale; returns the error relative to it."""
  scale = float(np.abs(theirs).max())
  error = float(np.abs(ours - theirs).max()) / scale
  print(f"{what}: max |ours - transformers| = {error:.2e} of the logits' scale {scale:.3g}")
  assert error <= TOL, (what, error)
  return error


def torch_logits(folder: Path, tokens: np.ndarray) -> np.ndarray:
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  return make_fixtures.logits(model, tokens.astype(np.int64))


def ours(folder: Path, tokens: np.ndarray) -> np.ndarray:
  return np.asarray(hf.load(folder)(jnp.asarray(tokens, jnp.int32)))


def checkpoint(tmp_path: Path, family: str) -> Path:
  """``family``'s seeded model as transformers 5's ``save_pretrained`` writes it, with a word-level tokenizer."""
  folder = tmp_path / family
  make_fixtures.build(family).save_pretrained(folder)
  write_tokenizer(folder)
  return folder


@pytest.mark.parametrize("family", FAMILIES)
def test_load_and_save_against_transformers5(tmp_path, family):
  folder = checkpoint(tmp_path, family)
  config = json.loads((folder / "config.json").read_text())
  assert "rope_parameters" in config and "rope_theta" not in config  # transformers 5's spelling
  tokens = np.random.default_rng().integers(0, config["vocab_size"], (3, 24))
  mine = ours(folder, tokens)
  assert_close(mine, torch_logits(folder, tokens), f"{family} load")
  saved = hf.save(hf.load(folder), tmp_path / "saved", source=config, tokenizer_from=folder)
  assert_close(mine, torch_logits(saved, tokens), f"{family} hf.save -> transformers")
  assert transformers.AutoConfig.from_pretrained(saved).to_dict()["rope_parameters"] == config["rope_parameters"]


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tune_and_export_load_in_transformers5(tmp_path, family):
  folder = checkpoint(tmp_path, family)
  rng = np.random.default_rng()
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": "question " + sentence(rng, 6), "completion": sentence(rng, 5)})
                          + "\n" for _ in range(200)))  # fmt: skip
  result = T.main(["--init-from", str(folder), "--data", str(rows), "--batch", "4", "--seq-len", "16", "--steps", "30",
                   "--eval-every", "0", "--eval-batches", "1", "--lr", "3e-3", "--out", str(tmp_path / "run"),
                   "--quiet"])  # fmt: skip
  losses = result["losses"]
  print(f"{family} fine-tune: loss {losses[1]:.3f} -> {losses[30]:.3f}")
  assert np.mean([losses[s] for s in range(26, 31)]) < losses[1]
  out = E.export(tmp_path / "run", tmp_path / "exported")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
  tokens = rng.integers(0, config["vocab_size"], (3, 16))
  mine = ours(out, tokens)
  assert_close(mine, torch_logits(out, tokens), f"{family} train.export -> transformers")
  assert float(np.abs(mine - ours(folder, tokens)).max()) > 0  # trained: not the checkpoint it started from


def _gpu() -> bool:
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
  return probe.stdout.strip().endswith("gpu")


def test_export_of_a_tied_model_beside_a_training_run_that_holds_the_gpu(tmp_path):
  """A run of the tied Llama 3.2 trains on the GPU; another takes 90 % of its memory and trains on; ``python -m
  train.export`` of the first, started as a user would (no JAX_PLATFORMS), writes a checkpoint transformers 5 loads
  with our logits."""
  if shutil.which("nvidia-smi") is None or not _gpu():
    pytest.skip("no GPU")
  folder = checkpoint(tmp_path, "llama32")
  rng = np.random.default_rng()
  rows = tmp_path / "rows.jsonl"
  rows.write_text("".join(json.dumps({"prompt": sentence(rng, 6), "completion": sentence(rng, 5)}) + "\n"
                          for _ in range(200)))  # fmt: skip
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  common = [sys.executable, "-m", "train.gpt", "--init-from", str(folder), "--data", str(rows), "--batch", "4",
            "--seq-len", "16", "--eval-every", "0", "--eval-batches", "1", "--quiet"]  # fmt: skip
  first = subprocess.run([*common, "--steps", "10", "--out", str(tmp_path / "first")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=240)  # fmt: skip
  assert first.returncode == 0, first.stderr[-3000:]
  holder_env = {**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"}
  log = open(tmp_path / "holder.log", "w")
  holder = subprocess.Popen([*common, "--steps", "1000000", "--ckpt-every", "0", "--no-ckpt", "--log-every", "1",
                             "--out", str(tmp_path / "holder")], env=holder_env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
  try:
    metrics = tmp_path / "holder" / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
      assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]
      assert time.time() < deadline, "the holding run did not start training"
      time.sleep(1)
    used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    print(f"GPU memory while the holding run trains (used, total): {used}")
    t0 = time.perf_counter()
    export = subprocess.run([sys.executable, "-m", "train.export", str(tmp_path / "first"), str(tmp_path / "out")],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)  # fmt: skip
    print(f"export beside it: rc {export.returncode} in {time.perf_counter() - t0:.1f} s: {export.stdout.strip()}")
    assert export.returncode == 0, export.stderr[-3000:]
    assert holder.poll() is None, "the holding run ended during the export"
  finally:
    holder.send_signal(signal.SIGINT)
    try:
      holder.wait(timeout=30)
    except subprocess.TimeoutExpired:
      holder.kill()
    log.close()
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert config["tie_word_embeddings"] and "lm_head.weight" not in hf.weight_files(tmp_path / "out")
  tokens = rng.integers(0, config["vocab_size"], (2, 16))
  assert_close(ours(tmp_path / "out", tokens), torch_logits(tmp_path / "out", tokens), "tied export beside a run")
