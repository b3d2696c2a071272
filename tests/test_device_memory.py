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
