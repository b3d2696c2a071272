"""A model too large for the GPUs as laid out is refused before anything is allocated, with what would fit
(``train/device_memory.py``; on a GPU ``train.gpt`` calls it with the device's memory, the CPU reports none)."""

from __future__ import annotations

import jax
import pytest

import jax_dos
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
  from train import gpt

  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's check (a GPU's is test_what_one_h100_holds')")
  with pytest.raises(SystemExit, match=r"gpt-30b \(.* parameters\) needs .* of RAM .* Nothing was allocated"):
    gpt.main(["--preset", "gpt-30b", "--out", str(tmp_path / "a"), "--steps", "1", "--no-ckpt", "--quiet"])
  tiny = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "128", "--quiet"]
  with pytest.raises(SystemExit, match=r"for 262144 rows .* fewer rows a micro-batch than 262144") as e:
    gpt.main([*tiny, "--batch", "262144", "--out", str(tmp_path / "b"), "--steps", "1", "--no-ckpt"])
  assert "largest preset" not in str(e.value), e.value


CARD_24GB = int(22.5 * 2**30)  # an H100 held to a 24 GB card's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.2825)
CARD_12GB = int(11 * 2**30)
STAGE = {name: device_memory.largest_stage(gpt_model.abstract_params(gpt_model.get_config(name, vocab_size=50304)))
         for name in ("gpt-6.7b", "gpt-13b")}  # fmt: skip


def test_the_largest_stage_is_the_largest_group_of_the_models_stages():
  """``largest_stage`` reads the parameter tree's shapes alone; it is the largest of the overlapped step's groups, but
  for what two entries of one group add (GPT's position embeddings beside its token embeddings): a lower bound."""
  cfg = gpt_model.get_config("tiny", vocab_size=50304)
  groups = gpt_model.staged(cfg).split(gpt_model.abstract_params(cfg))
  sizes = [sum(x.size for x in jax.tree.leaves(g)) for g in groups]
  assert max(sizes) - cfg.block_size * cfg.d_model <= device_memory.largest_stage(gpt_model.abstract_params(cfg))
  assert device_memory.largest_stage(gpt_model.abstract_params(cfg)) <= max(sizes)
  assert STAGE["gpt-6.7b"] == 50304 * 4096  # the token embeddings (tied to the head), larger than a block


def test_the_overlapped_step_counts_one_stages_gradients_not_all():
  """On a 24 GB card the 6.7B's bf16 weights (12.1 GiB) and one stage's gradients fit where every gradient beside
  them does not: refused for the plain step alone, with the smallest GPU that holds it; taken where the overlapped
  step may run. The 13B's weights alone exceed the card, and a 12 GB card holds neither model's weights."""
  n = COUNT["gpt-6.7b"]
  assert device_memory.refusal("gpt-6.7b", n, 2, 1, 1, "auto", CARD_24GB, PRESETS, STAGE["gpt-6.7b"]) is None
  said = device_memory.refusal("gpt-6.7b", n, 2, 1, 1, "auto", CARD_24GB, PRESETS)
  assert said is not None and "for its parameters and their gradients" in said, said
  assert f"a GPU of {4 * n / 0.8 / 2**30:.1f} GiB or more" in said and "gpt-2.7b" in said, said
  need = device_memory.need_bytes(n, 2, 1, 1, "auto", STAGE["gpt-6.7b"])
  assert need == 2 * (n + STAGE["gpt-6.7b"]), need
  said = device_memory.refusal("gpt-13b", COUNT["gpt-13b"], 2, 1, 1, "auto", CARD_24GB, PRESETS, STAGE["gpt-13b"])
  assert said is not None and "its largest stage's gradients (the overlapped step's least)" in said, said
  assert "the largest preset that fits as laid out now, gpt-6.7b" in said, said
  said = device_memory.refusal("gpt-6.7b", n, 2, 1, 1, "auto", CARD_12GB, PRESETS, STAGE["gpt-6.7b"])
  smallest = 2 * (n + STAGE["gpt-6.7b"]) / 0.8 / 2**30
  assert f"a GPU of {smallest:.1f} GiB or more" in said and "gpt-2.7b" in said, said


def test_the_plain_step_is_refused_where_its_program_does_not_fit_beside_the_weights():
  """The plain step's measured gradient program (every gradient and the activations: 15.5 GiB for the 6.7B at 4 rows
  a micro-batch) against what a GPU has free once the weights are there; with the plans' margin."""
  step = jax_dos.StepMemory(peak_bytes=int(15.5 * 2**30), live_bytes=int(12.0 * 2**30))
  said = device_memory.plain_step_refusal(step, free_bytes=int(10.0 * 2**30))
  assert said.startswith("the plain step's gradient program needs 15.5 GiB at its peak"), said
  assert "6.3 GiB more than a GPU's 10.0 GiB free" in said and "--grad-accum" in said, said
  assert device_memory.plain_step_refusal(step, free_bytes=int(70 * 2**30)) is None
  assert step.room_beside(int(70 * 2**30)) == int(0.92 * 70 * 2**30) - step.peak_bytes


def test_a_gpu_that_preallocated_nothing_is_read_from_the_card():
  """``XLA_PYTHON_CLIENT_PREALLOCATE=false``: the allocator's ``bytes_limit`` is what it holds so far; the memory it
  may use is the card's share (``XLA_PYTHON_CLIENT_MEM_FRACTION``), within what the card has free beside it."""
  gib = 2**30
  alone = jax_dos.DeviceMemory.growing(held=0, in_use=0, free=79 * gib, total=80 * gib, fraction=0.75)
  assert alone.limit_bytes == 60 * gib and alone.free_bytes == 60 * gib
  assert "XLA_PYTHON_CLIENT_PREALLOCATE=false: 0.75 of the card's 80.0 GiB" in alone.describe()
  shared = jax_dos.DeviceMemory.growing(held=2 * gib, in_use=gib, free=10 * gib, total=80 * gib, fraction=0.75)
  assert shared.limit_bytes == 12 * gib and shared.free_bytes == 11 * gib  # another process holds the rest
  assert jax_dos.DeviceMemory.of(jax.devices("cpu")[0]) is None  # the CPU reports no memory
