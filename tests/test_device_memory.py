"""A model too large for the GPUs as laid out is refused before anything is allocated, with what would fit
(``train/device_memory.py``; on a GPU ``train.gpt`` calls it with the device's memory, the CPU reports none)."""

from __future__ import annotations

import pytest

from models import gpt as gpt_model
from train import device_memory

H100 = int(0.94 * 79.1 * 2**30)  # an 80 GB H100's bytes_limit under train.gpt's memory fraction
PRESETS = [(name, gpt_model.param_count(gpt_model.get_config(name, vocab_size=50304))) for name in gpt_model.PRESETS]
COUNT = dict(PRESETS)


def test_the_30b_preset_is_30b():
  assert 29.9e9 < COUNT["gpt-30b"] < 30.1e9


def test_what_one_h100_holds():
  for name in ("gpt-6.7b", "gpt-13b"):  # 13B trains on one H100 with int8 moments (BENCHMARKS.md)
    assert device_memory.refusal(name, COUNT[name], 2, 1, 1, "auto", H100, PRESETS) is None
  said = device_memory.refusal("gpt-30b", COUNT["gpt-30b"], 2, 1, 1, "auto", H100, PRESETS)
  assert "gpt-30b (30.0 B parameters) needs 111.7 GiB a GPU" in said and "Nothing was allocated" in said, said
  assert "the largest preset that fits as laid out now, gpt-13b" in said and "--mesh fsdp" not in said, said  # 1 GPU


def test_across_four_h100s_the_advice_is_the_fsdp_degree_that_holds_it():
  said = device_memory.refusal("gpt-30b", COUNT["gpt-30b"], 2, 1, 4, "auto", H100, PRESETS)
  assert "shard the parameters over 2 GPUs (--mesh fsdp=2" in said, said
  assert device_memory.refusal("gpt-30b", COUNT["gpt-30b"], 2, 2, 4, "auto", H100, PRESETS) is None


@pytest.mark.parametrize("offload, refused", [("none", True), ("auto", False)])
def test_offload_none_counts_optaxs_float32_state(offload, refused):
  param_bytes = 4 if offload == "none" else 2  # --offload none trains float32 parameters
  said = device_memory.refusal("gpt-6.7b", COUNT["gpt-6.7b"], param_bytes, 1, 1, offload, H100, PRESETS)
  assert (said is not None) == refused
  if refused:
    assert "--offload auto" in said and "float32 state" in said, said


H100_HOST = int(125.9 * 2**30)  # the lent one-H100 machine's RAM
TWO_H100_HOST = int(251.8 * 2**30)


def test_what_a_host_holds_beside_its_gpus():
  """13B with float32 moments (151 GB of state) cannot fit one H100 and its 125.9 GiB host, whatever the plan:
  refused with the compact moments that fit (int8 on one GPU, as BENCHMARKS.md measured) and the GPUs of such a
  host that would hold it (3: each keeps 11 GiB resident); on the two-H100 host it fits, and 6.7B fits one."""
  said = device_memory.host_refusal("gpt-13b", COUNT["gpt-13b"], 2, 1, 1, 1, "float32", H100, H100_HOST, PRESETS)
  assert "gpt-13b (12.9 B parameters) with float32 moments keeps at least" in said and "Nothing was allocated" in said
  assert "--moments bfloat16" in said and "train on 3 GPUs of such a host" in said, said
  assert "the largest preset that fits here, gpt-6.7b" in said, said
  assert device_memory.host_refusal("gpt-13b", COUNT["gpt-13b"], 2, 1, 2, 1, "float32", H100, TWO_H100_HOST) is None
  assert device_memory.host_refusal("gpt-6.7b", COUNT["gpt-6.7b"], 2, 1, 1, 1, "float32", H100, H100_HOST) is None
  assert device_memory.host_refusal("gpt-13b", COUNT["gpt-13b"], 2, 1, 1, 1, "int8", H100, H100_HOST) is None


def test_30b_on_a_host_of_two_h100s():
  """30B (335 GiB of float32 state) on 2 H100s sharded fsdp=2 and their 251.8 GiB host: float32 does not fit,
  bfloat16 does; int8 is not offered on a mesh; two such hosts hold float32 (each its half)."""
  said = device_memory.host_refusal("gpt-30b", COUNT["gpt-30b"], 2, 2, 2, 1, "float32", H100, TWO_H100_HOST, PRESETS)
  assert said is not None and "--moments bfloat16" in said and "int8" not in said, said
  assert device_memory.host_refusal("gpt-30b", COUNT["gpt-30b"], 2, 2, 2, 1, "bfloat16", H100, TWO_H100_HOST) is None
  assert device_memory.host_refusal("gpt-30b", COUNT["gpt-30b"], 2, 2, 4, 2, "float32", H100, TWO_H100_HOST) is None


CPU_HOST = int(23.5 * 2**30)  # the CPU machine's RAM


def test_without_a_gpu_the_ram_holds_parameters_gradients_and_state():
  """On the CPU backend the parameters, gradients and optimizer state share the RAM: 30B is refused before anything
  is allocated, with the largest preset whose parameters and state fit; 1.3B's fit, and its activations (the
  gradient step's peak beyond them) are what to cut: fewer rows, not another preset."""
  said = device_memory.ram_refusal("gpt-30b", COUNT["gpt-30b"], 2, 1, 1, 1, "auto", "float32", CPU_HOST, PRESETS)
  need = (2 + 2 + 12) * COUNT["gpt-30b"] / 2**30  # bfloat16 parameters and gradients, float32 master, mu and nu
  assert f"gpt-30b (30.0 B parameters) needs {need:.1f} GiB of RAM" in said and "before any activation" in said, said
  assert "Nothing was allocated" in said and "the largest preset whose parameters and state fit here, gpt-1.3b" in said
  assert "--moments" not in said, said  # no compact format brings 30B within 20 GiB
  small = device_memory.ram_refusal("gpt-1.3b", COUNT["gpt-1.3b"], 2, 1, 1, 1, "auto", "float32", CPU_HOST, PRESETS)
  assert small is None
  said = device_memory.ram_refusal("gpt-1.3b", COUNT["gpt-1.3b"], 2, 1, 1, 1, "auto", "float32", CPU_HOST, PRESETS,
                                   step_bytes=100 * 2**30, rows=16)  # fmt: skip
  assert "its gradient step's activations and temporaries for 16 rows (100.0 GiB)" in said, said
  assert "fewer rows a micro-batch than 16" in said and "largest preset" not in said, said
  assert "Nothing but the parameters was allocated" in said, said
  # bfloat16 moments bring 6.7B's parameters and state (26.2 + 52.4 GiB) within a host of 100 GiB
  said = device_memory.ram_refusal("gpt-6.7b", COUNT["gpt-6.7b"], 2, 1, 1, 1, "auto", "float32", 100 * 2**30)
  assert "--moments bfloat16" in said, said


def test_the_script_on_the_cpu_refuses_what_its_ram_cannot_hold(tmp_path):
  """``python -m train.gpt`` on the CPU backend: a model too large for the RAM ends before its parameters are made;
  a batch whose activations no such machine holds ends once the gradient step is compiled, before the state exists.
  Both are clean exits (``SystemExit``) with the numbers, where the kernel would otherwise end the process unsaid."""
  import jax

  from train import gpt

  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's check (a GPU's is test_what_one_h100_holds')")
  with pytest.raises(SystemExit, match=r"gpt-30b \(.* parameters\) needs .* of RAM .* Nothing was allocated"):
    gpt.main(["--preset", "gpt-30b", "--out", str(tmp_path / "a"), "--steps", "1", "--no-ckpt", "--quiet"])
  tiny = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "128", "--quiet"]
  with pytest.raises(SystemExit, match=r"for 262144 rows .* fewer rows a micro-batch than 262144") as e:
    gpt.main([*tiny, "--batch", "262144", "--out", str(tmp_path / "b"), "--steps", "1", "--no-ckpt"])
  assert "largest preset" not in str(e.value), e.value
