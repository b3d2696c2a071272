"""The overlapped step's timeline model (``jax_dos.planning.timeline``): worked cases and the placements it picks."""

import dataclasses

import pytest

from jax_dos.planning.collectives import STREAM_DRAM_SHARE, Collectives
from jax_dos.planning.fired import fired_bound, fired_share, simulate_fired
from jax_dos.planning.timeline import (
  HostBytes,
  Rates,
  StageTimes,
  Subgroup,
  choose_placements,
  simulate,
  stream_rate_during_backward,
)

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
    for p in (("host", "host"), ("stream", "host"), ("host", "stream"), ("stream", "stream"))
  )


def test_choose_streams_when_the_host_is_slow():
  slow_host = Rates(host=0.01, stream=4.0, device=100.0, host_concurrent=0.01, stream_concurrent=4.0)
  placements, _ = choose_placements(TIMES, [Subgroup(3, 1), Subgroup(3, 2)], 0, slow_host)
  assert placements == ["stream", "stream"]
  placements, _ = choose_placements(TIMES, [Subgroup(3, 1), Subgroup(3, 2)], 0, slow_host, allow_stream=False)
  assert placements == ["host", "host"]


def test_the_stream_path_is_capped_while_the_backward_pass_runs():
  # Stage 2's 6 parameters are handed over at 2 s. Uncapped, at 4/s: done at 3.5 s. Capped at 1/s until the backward
  # pass ends at 6 s (4 parameters), then 2 more at 4/s: done at 6.5 s.
  uncapped = simulate(TIMES, [Subgroup(6, 2)], ["stream"], RATES)
  assert uncapped["stream_end_s"] == pytest.approx(3.5)
  capped = Rates(**{**RATES.__dict__, "stream_backward": 1.0})
  assert simulate(TIMES, [Subgroup(6, 2)], ["stream"], capped)["stream_end_s"] == pytest.approx(6.5)
  # Begun after the backward pass, a subgroup is not capped.
  assert simulate(TIMES, [Subgroup(100, 0), Subgroup(4, 0)], ["host", "stream"], capped)["stream_end_s"] == (
    pytest.approx(6.0 + 4 / RATES.stream_concurrent)
  )


def test_choose_streams_the_last_stages_when_the_stream_path_works_during_the_backward_pass():
  # Streamed, stage 2 (handed over at 2 s) gets 4 s of the backward pass at 1/s and is done at 8 s, in time for its
  # use at 8 s; the host does stage 1 from 4 s to 6 s. The other way round the host needs stage 2 until 10 s.
  rates = Rates(host=1.0, stream=2.0, device=100.0, host_concurrent=1.0, stream_concurrent=2.0, stream_backward=1.0)
  subgroups = [Subgroup(2, 1), Subgroup(8, 2)]
  placements, result = choose_placements(TIMES, subgroups, 0, rates)
  assert placements == ["host", "stream"]
  assert result["exposed_s"] == pytest.approx(0.0)
  assert simulate(TIMES, subgroups, ["stream", "host"], rates)["exposed_s"] == pytest.approx(2.0)


def test_the_stream_rate_during_the_backward_pass_is_one_subgroup_per_queued_stage_programs():
  # 2 s a backward stage, 2 stage programs queued ahead: a 12-parameter subgroup every 6 s.
  assert stream_rate_during_backward(TIMES, 12, run_ahead_stages=2) == pytest.approx(2.0)


def test_stage_times_are_checked():
  with pytest.raises(ValueError, match="one forward and one backward"):
    StageTimes((1.0,), (1.0, 2.0))
  with pytest.raises(ValueError, match=">= 0"):
    StageTimes((1.0,), (-1.0,))


def test_the_stage_order_window_is_every_micro_batchs_programs_back_to_back():
  # Two micro-batches in the "stage" order: each stage's two programs run in a row, so stage 2's gradient is complete
  # at 4 s of a 12 s backward pass, and its use in the next forward pass comes after stage 0's two forward programs
  # and stage 1's; in the "batch" order the window is the last micro-batch's backward pass alone.
  stage = TIMES.per_window(2, "stage")
  assert stage.backward == (4.0, 4.0, 4.0) and stage.forward == (2.0, 2.0, 2.0)
  assert TIMES.per_window(2, "batch") == TIMES
  # 20 parameters of stage 2 on the host at 2/s: 10 s. From 4 s they end at 14 s; stage 2 runs at 12 + 2 + 2 = 16 s.
  assert simulate(stage, [Subgroup(20, 2)], ["host"], RATES)["exposed_s"] == pytest.approx(0.0)
  # One micro-batch's window: handed over at 2 s, done at 12 s, needed at 6 + 1 + 1 = 8 s.
  assert simulate(TIMES, [Subgroup(20, 2)], ["host"], RATES)["exposed_s"] == pytest.approx(4.0)
  with pytest.raises(ValueError, match="micro_batch_order"):
    TIMES.per_window(2, "interleaved")


def test_streamed_speculation_beyond_its_cap_waits_for_the_decision():
  # Two streamed subgroups of 4 handed over at 2 s (stage 2) and 4 s (stage 1), uncapped at 4/s: the first runs 2-3 s,
  # the second 4-5 s. With speculation for 4 parameters only, the second waits for the decision at 6 s.
  subgroups = [Subgroup(4, 1), Subgroup(4, 2)]
  free = simulate(TIMES, subgroups, ["stream", "stream"], RATES)
  assert free["stream_end_s"] == pytest.approx(5.0)
  capped = simulate(TIMES, subgroups, ["stream", "stream"], RATES, stream_speculation=4)
  assert capped["stream_end_s"] == pytest.approx(7.0)
  assert simulate(TIMES, subgroups, ["stream", "stream"], RATES, stream_speculation=0)["stream_end_s"] == (
    pytest.approx(8.0)
  )


def test_choose_keeps_within_the_host_budget():
  # Host placement costs 28 B a bfloat16 parameter, streaming 12 B plus 12 B for each one speculated on.
  fast_host = Rates(host=4.0, stream=1.0, device=100.0, host_concurrent=4.0, stream_concurrent=1.0)
  subgroups = [Subgroup(10, 1), Subgroup(10, 2)]
  per = HostBytes()
  assert per.fixed(subgroups, ["host", "stream"]) == 10 * 28 + 10 * 12
  unlimited, result = choose_placements(TIMES, subgroups, 0, fast_host)
  assert unlimited == ["host", "host"] and result["stream_speculation"] is None
  budget = 10 * 28 + 10 * 12 + 5 * 12  # one subgroup on the host at most
  placements, result = choose_placements(TIMES, subgroups, 0, fast_host, host_budget_bytes=budget)
  assert placements.count("host") == 1
  assert result["stream_speculation"] == (budget - per.fixed(subgroups, placements)) // 12
  assert per.fixed(subgroups, placements) + 12 * min(result["stream_speculation"], 10) <= budget
  # Nothing fits: the placement needing the fewest bytes (all streamed, no speculation), for the caller to refuse.
  placements, result = choose_placements(TIMES, subgroups, 0, fast_host, host_budget_bytes=1)
  assert placements == ["stream", "stream"] and result["stream_speculation"] == 0


def test_a_fired_step_starts_every_offloaded_update_at_the_decision_and_shares_the_host_work():
  # Three host subgroups of 4 parameters, one a stage. After the decision: host 1/s (its concurrent rate, the kernel
  # not measured), stream 2/s. In forward order each goes to the path that would finish it first: stage 0's to the
  # stream path (2 s against 4 s), stage 1's to the host (4 s; the stream path would also take 4 s: ties stay),
  # stage 2's to the stream path (4 s against 8 s).
  subgroups = [Subgroup(4, 0), Subgroup(4, 1), Subgroup(4, 2)]
  placements = ["host"] * 3
  assert fired_share(subgroups, placements, RATES) == {0, 2}
  fired = simulate_fired(TIMES, subgroups, placements, RATES)
  # Decision at 6 s. Stream: stage 0's at 8 s, stage 2's at 10 s; host: stage 1's at 10 s. The forward starts at
  # 6 s: stage 0 waits for 8 s (to 9 s), stage 1 for 10 s (to 11 s), stage 2 runs to 12 s.
  assert fired["host_end_s"] == pytest.approx(10.0) and fired["stream_end_s"] == pytest.approx(10.0)
  assert fired["exposed_s"] == pytest.approx(12.0 - (6.0 + 3.0))
  silent = simulate(TIMES, subgroups, placements, RATES)
  assert silent["exposed_s"] < fired["exposed_s"]  # a silent step hides the host work under the backward pass
  # Resident subgroups need no decision to wait for beyond their own update.
  assert simulate_fired(TIMES, [Subgroup(100, 0)], ["device"], RATES)["exposed_s"] == pytest.approx(1.0)


def test_the_fired_share_follows_the_forward_order_where_the_last_ones_left_the_host_alone():
  # Four stages of 3 host parameters; host 1/s, stream 2/s after the decision (6 s). Sharing the last ones (the two
  # paths ending together: 8 of 12 on the stream path) would leave stages 0 and 1 to the host, stage 1's weights
  # final at 12 s; list scheduling in forward order keeps both paths on the stages needed first.
  times = StageTimes(forward=(1.0,) * 4, backward=(1.5,) * 4)
  subgroups = [Subgroup(3, j) for j in range(4)]
  share = fired_share(subgroups, ["host"] * 4, RATES)
  assert share == {0, 2, 3}  # stream: 1.5, 3 (stage 2), 4.5 (stage 3) s; host: stage 1 at 3 s
  fired = simulate_fired(times, subgroups, ["host"] * 4, RATES)
  # Stage 0 ready at 7.5 s (to 8.5), stage 1 at 9 (to 10), stage 2 at 9 (10 to 11), stage 3 at 10.5 (11 to 12).
  assert fired["exposed_s"] == pytest.approx(12.0 - (6.0 + 4.0))
  bound = fired_bound(times, subgroups, ["host"] * 4, RATES)
  # Both paths (3/s) on the forward order: stage j's weights at 6 + 3 (j + 1) / 3 s: 7, 8, 9, 10; the forward
  # pass 7 to 8, 8 to 9, 9 to 10, 10 to 11: 1 s exposed, the last stage's 12 parameters at 3/s less 3 s of forward.
  assert bound["exposed_s"] == pytest.approx(1.0)
  assert bound["host_end_s"] == bound["stream_end_s"] == pytest.approx(10.0)
  assert bound["exposed_s"] <= fired["exposed_s"]


def test_the_fired_bound_is_below_every_split_and_counts_the_resident_update():
  subgroups = [Subgroup(50, 0), Subgroup(4, 1), Subgroup(2, 2), Subgroup(3, 2)]
  placements = ["device", "host", "stream", "host"]
  bound = fired_bound(TIMES, subgroups, placements, RATES)["exposed_s"]
  assert bound <= simulate_fired(TIMES, subgroups, placements, RATES)["exposed_s"] + 1e-12
  for stream_rate in (0.5, 2.0, 8.0):  # any split of the same work at rates that add up to no more
    rates = dataclasses.replace(RATES, host_concurrent=3.0 - stream_rate / 4, stream_concurrent=stream_rate / 4)
    assert fired_bound(TIMES, subgroups, placements, rates)["exposed_s"] <= (
      simulate_fired(TIMES, subgroups, placements, rates)["exposed_s"] + 1e-12)  # fmt: skip
  # All resident: the update on the accelerator, 100 parameters at 100/s, is what is exposed.
  assert fired_bound(TIMES, [Subgroup(100, 0)], ["device"], RATES)["exposed_s"] == pytest.approx(1.0)


def test_after_the_decision_the_host_runs_its_kernel_alone_at_the_paths_slowdown():
  rates = dataclasses.replace(RATES, host_kernel=3.0, stream_concurrent=0.5)  # k h_c / h = 3 x 1 / 2
  assert rates.host_after_decision == pytest.approx(1.5)
  assert RATES.host_after_decision == RATES.host_concurrent  # the kernel not measured
  one = simulate_fired(TIMES, [Subgroup(3, 2)], ["host"], rates)
  assert one["host_end_s"] == pytest.approx(6.0 + 3 / 1.5)


def test_data_parallel_collectives_partitioned():
  # 2 ranks of one host, 4 B/s a link, 2 B a gradient and a weight: a stage of z parameters reduce-scatters z x 2 x 1/2
  # bytes (z / 4 s) and all-gathers as much; each rank updates z / 2 of them at the host's 2/s shared by 2 processes.
  dp = Collectives(ranks=2, link=4.0, partitioned=True, ranks_per_host=2)
  result = simulate(TIMES, [Subgroup(4, 2), Subgroup(2, 0)], ["host", "host"], RATES, collectives=dp)
  # Reductions on the link: stage 2's 1 s after its backward (2 s) ends at 3 s, stage 0's 0.5 s after 6 s at 6.5 s.
  assert result["reduce_end_s"] == result["backward_end_s"] == pytest.approx(6.5)
  # Host at 1/s: stage 2's 2 parameters from 3 s to 5 s, stage 0's 1 from the decision (6.5 s) to 7.5 s.
  assert result["host_end_s"] == pytest.approx(7.5)
  # All-gathers in stage order: stage 0's 0.5 s after its update (8 s), stage 2's 1 s after it (9 s).
  assert result["gather_end_s"] == pytest.approx(9.0)
  # Forward: stage 0 at 8 s, stages 1 and 2 after it, ending at 11 s: 2 s later than the 9 s of compute.
  assert result["forward_end_s"] == pytest.approx(11.0)
  assert result["exposed_s"] == pytest.approx(2.0)


def test_data_parallel_collectives_replicated_and_one_rank():
  # The state in the parameters' layout: each stage's gradient all-reduced (twice a reduce-scatter's bytes: z / 2 s),
  # every rank updating whole subgroups, nothing gathered.
  dp = Collectives(ranks=2, link=4.0, partitioned=False)
  result = simulate(TIMES, [Subgroup(4, 2), Subgroup(2, 0)], ["host", "host"], RATES, collectives=dp)
  assert result["backward_end_s"] == pytest.approx(7.0)  # stage 0's 1 s all-reduce after 6 s
  assert result["host_end_s"] == pytest.approx(8.0)  # 4 at 2/s from 4 s to 6 s, then 2 from 7 s to 8 s
  assert result["gather_end_s"] == pytest.approx(7.0)
  assert result["exposed_s"] == pytest.approx(2.0)  # stage 0 waits until 8 s: forward ends at 11 s
  # One rank: no link time, the whole state, the host's whole rate: the single-device timeline.
  alone = simulate(TIMES, [Subgroup(4, 2), Subgroup(2, 0)], ["host", "stream"], RATES)
  one = simulate(TIMES, [Subgroup(4, 2), Subgroup(2, 0)], ["host", "stream"], RATES, collectives=Collectives(1, 1.0))
  assert {k: one[k] for k in alone} == pytest.approx(alone)
  with pytest.raises(ValueError, match="ranks >= 1"):
    Collectives(0, 1.0)
  with pytest.raises(ValueError, match="ranks_per_host <= ranks"):
    Collectives(2, 1.0, ranks_per_host=3)


def test_data_parallel_collectives_fired_clip():
  # The fired step on the same 2 ranks: nothing offloaded starts before the decision, after the last reduction.
  dp = Collectives(ranks=2, link=4.0, partitioned=True, ranks_per_host=2)
  subgroups = [Subgroup(4, 2), Subgroup(2, 0)]
  fired = simulate_fired(TIMES, subgroups, ["host", "host"], RATES, collectives=dp)
  assert fired["backward_end_s"] == pytest.approx(6.5)  # the reductions end as in the silent step
  # A rank's shares: stage 0's 1 parameter, stage 2's 2; the host's DRAM shared by 2 ranks halves both paths'
  # concurrent rates (host 0.5/s, stream 1/s). In forward order each goes where it ends first: stage 0's to the stream
  # path (6.5 s to 7.5 s, against 8.5 s on the host), then stage 2's too (7.5 s to 9.5 s, against 10.5 s).
  assert fired["stream_end_s"] == pytest.approx(9.5)
  assert fired["host_end_s"] == pytest.approx(6.5)
  assert fired["gather_end_s"] > fired["stream_end_s"]  # the last stage's weights gathered after its update
  alone = simulate_fired(TIMES, subgroups, ["host", "host"], RATES)
  assert alone["backward_end_s"] == pytest.approx(6.0) and "gather_end_s" not in alone
  silent = simulate(TIMES, subgroups, ["host", "host"], RATES, collectives=dp)
  assert silent["exposed_s"] < fired["exposed_s"]


def test_ranks_of_one_host_share_its_dram_not_their_links():
  # The host kernel alone at k = 4/s: the host's DRAM moves 4 kernel parameters a second. Two ranks: each kernel
  # parameter takes 2/4 s of DRAM, and the host path's copies (1/h - 1/k = 1/2 - 1/4 s) run on each rank's own link.
  dp = Collectives(ranks=2, link=4.0, ranks_per_host=2)
  rates = dataclasses.replace(RATES, host_kernel=4.0, stream_backward=3.0)
  shared = dp.shared_rates(rates)
  assert shared.host == pytest.approx(1 / (2 / 4 + 1 / 2 - 1 / 4))
  assert shared.stream == pytest.approx(min(4.0, 4 / (STREAM_DRAM_SHARE * 2)))  # the DRAM binds: 2.22/s
  # Both paths on both ranks ask for 2 (1 + 0.9 x 2) = 5.6 > 4 kernel parameters a second: scaled to fit.
  fits = 4 / (2 * (1.0 + STREAM_DRAM_SHARE * 2.0))
  assert shared.host_concurrent == pytest.approx(1.0 * fits)
  assert shared.stream_concurrent == pytest.approx(2.0 * fits)
  assert shared.stream_backward == pytest.approx(shared.stream)
  # A DRAM fast enough for both ranks leaves each its own rates; one rank, or no kernel rate measured (every rate
  # shared, as if the DRAM bound every path), as before.
  fast = dp.shared_rates(dataclasses.replace(RATES, host=2.0, host_kernel=1e9))
  assert (fast.host, fast.stream, fast.host_concurrent, fast.stream_concurrent) == pytest.approx((2.0, 4.0, 1.0, 2.0))
  assert Collectives(ranks=2, link=4.0).shared_rates(rates) == rates
  blind = dp.shared_rates(RATES)
  assert (blind.host, blind.stream, blind.host_concurrent, blind.stream_concurrent) == (1.0, 2.0, 0.5, 1.0)


def test_plain_step_collectives_and_speculation_share():
  # The plain step's collectives, none hidden: a reduce-scatter a micro-batch (z / 4 s at 2 ranks, 4 B/s), one
  # all-gather (as long): 2 micro-batches of 8 parameters: 2 x 2 + 2 s.
  dp = Collectives(ranks=2, link=4.0)
  assert dp.plain_step_s(8, micro_batches=2) == pytest.approx(6.0)
  assert Collectives(ranks=2, link=4.0, partitioned=False).plain_step_s(8, 2) == pytest.approx(8.0)
  # A speculation cap counts the model's parameters: a rank's share of a 6-parameter subgroup is 3, within a cap of 6.
  capped = simulate(TIMES, [Subgroup(6, 2)], ["stream"], RATES, stream_speculation=6, collectives=dp)
  free = simulate(TIMES, [Subgroup(6, 2)], ["stream"], RATES, collectives=dp)
  assert capped["stream_end_s"] == pytest.approx(free["stream_end_s"])
  held = simulate(TIMES, [Subgroup(6, 2)], ["stream"], RATES, stream_speculation=5, collectives=dp)
  assert held["stream_end_s"] > free["stream_end_s"]
