"""The overlapped step's timeline model (``jax_dos.timeline``): worked cases and the placements it picks."""

import pytest

from jax_dos.timeline import Rates, StageTimes, Subgroup, choose_placements, simulate

TIMES = StageTimes(forward=(1.0, 1.0, 1.0), backward=(2.0, 2.0, 2.0))  # the backward pass ends at 6 s
RATES = Rates(host=2.0, stream=4.0, device=100.0, host_concurrent=1.0, stream_concurrent=2.0)


def test_a_host_subgroup_hidden_and_one_exposed():
  # Stage 2's gradient is handed over at 2 s; 4 parameters at 2/s: done at 4 s, long before stage 2's next use.
  hidden = simulate(TIMES, [Subgroup(4, 2)], ["host"], RATES)
  assert hidden["host_end_s"] == pytest.approx(4.0)
  assert hidden["exposed_s"] == pytest.approx(0.0)
  # Stage 0's gradient comes last (6 s) and is needed first: 4 parameters at 2/s delay the whole forward by 2 s.
  exposed = simulate(TIMES, [Subgroup(4, 0)], ["host"], RATES)
  assert exposed["exposed_s"] == pytest.approx(2.0)


def test_resident_update_and_concurrent_rates():
  subgroups = [Subgroup(100, 0), Subgroup(2, 1), Subgroup(2, 2)]
  result = simulate(TIMES, subgroups, ["device", "stream", "host"], RATES)
  # Resident: 100 / 100 = 1 s after the backward pass. Host at its concurrent rate: 2 s from 2 s to 4 s; stream:
  # 1 s from 4 s to 5 s. The forward starts at 7 s and is never held up.
  assert result["host_end_s"] == pytest.approx(4.0)
  assert result["stream_end_s"] == pytest.approx(5.0)
  assert result["exposed_s"] == pytest.approx(1.0)


def test_choose_keeps_first_stages_resident_and_last_on_the_host():
  subgroups = [Subgroup(3, 0), Subgroup(3, 1), Subgroup(3, 2)]
  placements, result = choose_placements(TIMES, subgroups, 3, RATES)
  assert placements[0] == "device"
  assert placements[2] == "host"
  assert result["exposed_s"] == min(
    simulate(TIMES, subgroups, ["device", *p], RATES)["exposed_s"]
    for p in (("host", "host"), ("stream", "host"), ("stream", "stream"))
  )


def test_choose_streams_when_the_host_is_slow():
  slow_host = Rates(host=0.01, stream=4.0, device=100.0, host_concurrent=0.01, stream_concurrent=4.0)
  placements, _ = choose_placements(TIMES, [Subgroup(3, 1), Subgroup(3, 2)], 0, slow_host)
  assert placements == ["stream", "stream"]
  placements, _ = choose_placements(TIMES, [Subgroup(3, 1), Subgroup(3, 2)], 0, slow_host, allow_stream=False)
  assert placements == ["host", "host"]


def test_stage_times_are_checked():
  with pytest.raises(ValueError, match="one forward and one backward"):
    StageTimes((1.0,), (1.0, 2.0))
  with pytest.raises(ValueError, match=">= 0"):
    StageTimes((1.0,), (-1.0,))
