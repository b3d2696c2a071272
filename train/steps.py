"""The training script's steps: the plain and the overlapped step behind one interface, and the choice between them.

Either step is used the same way by the training loop::

    loss = step(batch)            # one optimizer step; an accelerator scalar
    step.grad_norm                # the step's global gradient norm before the clip (an accelerator scalar)
    step.settle()                 # wait for the pending update (before an evaluation or a save)
    step.params, step.opt_state   # the current trees, in the model's layout; the next step consumes them
    step.close()

:class:`PlainStep` runs the jitted gradient step, then ``jax_dos.update_params``
(the interleaved engine) or optax's AdamW (``--offload none``).
``train.overlapped.OverlappedTraining`` runs ``jax_dos.OverlappedStep`` on the
model's stages. :func:`choose` picks one from the two plans, both made from
shapes before any optimizer state exists, and says why in one line.
"""

from __future__ import annotations

from typing import Any

import jax

import jax_dos
from train.flags import TrainConfig
from train.optimizer import optimizer_step


class PlainStep:
  """The gradient step then the optimizer's update, each step; the parameters and state are held here."""

  def __init__(self, args: TrainConfig, tx, graphdef, grad_step, params: Any, opt_state: Any, plan=None):
    self._args, self._tx, self._graphdef, self._grad_step = args, tx, graphdef, grad_step
    self._params, self._opt_state, self.plan = params, opt_state, plan
    self.grad_norm: jax.Array | None = None

  def __call__(self, batch: Any) -> jax.Array:
    loss, grads, scale, self.grad_norm = self._grad_step(self._graphdef, self._params, batch, self._args.clip)
    self._params, self._opt_state = optimizer_step(self._args, self._tx, grads, self._opt_state, self._params, scale)
    return loss  # the gradients are dropped here: the planner counts them through the update only

  def settle(self) -> None:
    """Waits for the update (with ``--delay 1``, the host's update that runs a step late)."""
    if self._args.delay:
      jax_dos.wait_for_host_updates()
    jax.block_until_ready(self._params)

  @property
  def params(self) -> Any:
    return self._params

  @property
  def opt_state(self) -> Any:
    return self._opt_state

  def close(self) -> None:
    self.settle()


def predicted_step_s(plan: jax_dos.Plan | None, compute_s: float | None) -> float | None:
  """A plan's predicted step: the overlapped plan's own, or ``compute_s`` (the forward/backward) plus the plain
  plan's update phase; ``None`` where the plan holds no prediction."""
  if plan is None:
    return None
  if "step" in plan.predicted:
    return plan.predicted["step"]
  if "total" in plan.predicted and compute_s is not None:
    return compute_s + plan.predicted["total"]
  return None


# The share of steps whose clip fires, where the run has no record of its own: a run's clip fires at its start and
# goes silent (the README's 6.7B from scratch: the norm fell from 290 to 4.8 in 25 steps under a clip of 1.0).
FIRED_PRIOR = 0.5
RECORD_STEPS = 50  # the last steps of a resumed run's record that give its fired share


def fired_share(
  clip: float, metrics_rows: list[dict[str, Any]] | None = None, first_norm: float | None = None
) -> tuple[float, str]:
  """``(share of steps whose clip is expected to fire, where that comes from)``: none without a clip, the last
  :data:`RECORD_STEPS` steps' record of a resumed run (``metrics.jsonl``'s rows); for a fresh run, where the first
  micro-batch's gradient norm at the initial weights (``first_norm``) was measured, every step where it exceeds the
  clip and none where it does not; else :data:`FIRED_PRIOR`.

  Why all or none: a run's gradient norm is largest at its start, and in every committed run of 1.3B to 30B
  parameters with the default clip (1.0) the clip fired in every step recorded (12 to 112 of them, norms 290 at the
  start to 1.4 at step 112 at 6.7B); a norm under the clip at the start (``--clip 1e6``) leaves it silent."""
  if clip <= 0:
    return 0.0, "no clip"
  fired = [bool(r["clipped"]) for r in (metrics_rows or []) if "clipped" in r][-RECORD_STEPS:]
  if fired:
    return sum(fired) / len(fired), f"the run's last {len(fired)} steps"
  if first_norm is not None:
    above = first_norm > clip
    sign = ">" if above else "<="
    return (1.0 if above else 0.0), f"the first batch's gradient norm {first_norm:.3g} {sign} the clip"
  return FIRED_PRIOR, "prior"


def choose(
  mode: str,
  plain: jax_dos.Plan | None,
  overlapped: jax_dos.Plan | None,
  refusal: str | None,
  fired: tuple[float, str] = (FIRED_PRIOR, "prior"),
  plain_collectives_s: float = 0.0,
  plain_refused: str | None = None,
) -> tuple[bool, str]:
  """``(overlapped?, one line saying which step and why)`` for ``--overlap mode``.

  ``auto`` takes the overlapped step where both plans predict a step, the
  overlapped one is shorter with the clip silent, and either its expected step
  ``(1 - p) silent + p fired`` is shorter than the plain one (``p``, ``where``
  = ``fired``: the share of steps whose clip fires, :func:`fired_share`) or its
  fired step is a tie with the plain one (within ``jax_dos.PREDICTION_ERROR``,
  the model's measured error, of it; the plain step takes as long fired or
  silent). Where either plan keeps all the state resident (a mesh whose GPUs
  hold their shares), the overlapped step must instead be faster by more
  than that error on its expected step, with no tie: with all of it
  resident, the overlapped step has no update to hide and gains only by its
  stages' programs (their rematerialisation; on ``fsdp``, one block's
  weights gathered at a time), which the prediction prices. ``on`` takes it unless it
  is refused; ``off`` never does. The line gives each step's predicted time,
  the rematerialisation the overlapped plan chose beside its placements
  (``Plan.remat``), and the rule's figures. ``plain_collectives_s``: on a
  mesh, what the plain step's reductions and gathers add to its step
  (``jax_dos.Collectives.plain_step_s``; the overlapped plan prices its own).

  ``plain_refused``: why the plain step cannot run here: its state cannot be held (``jax_dos.get_plan``'s
  ``MemoryError``, its plan keeping every offloaded subgroup on the host), or its gradient program does not fit the
  GPU beside the parameters (it makes every gradient before the update): the overlapped step is then taken where it
  can be (``on`` or ``auto``, a plan, no ``refusal``), else the run ends (``SystemExit``) with that reason and the
  overlapped step's.
  """
  if plain_refused is not None:
    if refusal is not None or mode == "off" or overlapped is None:
      why = "--overlap off" if mode == "off" else refusal or "no overlapped plan"
      raise SystemExit(f"error: {plain_refused} The overlapped step, which holds less on the accelerator and may keep"
                       f" more of the state there, is not taken: {why}.")  # fmt: skip
    return True, f"step    overlapped: the plain step does not fit here ({plain_refused.split(':')[0]})"
  compute = fired_s = None
  if overlapped is not None and "step" in overlapped.predicted:  # the plain step's forward/backward, as timed
    compute = overlapped.predicted.get("compute_plain", overlapped.predicted["step"] - overlapped.predicted["exposed"])
    fired_s = overlapped.predicted.get("step_clip_fired")
  silent, alone = predicted_step_s(overlapped, None), predicted_step_s(plain, compute)
  alone = None if alone is None else alone + plain_collectives_s
  shown = []
  if silent is not None:
    remat = "" if overlapped.remat is None else f", remat {jax_dos.describe_remat(overlapped.remat)}"
    own = silent - overlapped.predicted["exposed"]  # its forward and backward, as the plan measured its stages
    bound = overlapped.predicted.get("step_clip_fired_bound")
    fired_text = "" if fired_s is None else f"; {fired_s:.2f} s after a fired clip"
    fired_text += "" if bound is None else f", {bound:.2f} s at best (the host's rates, the next forward pass)"
    if jax_dos.resolved_speculation("auto", overlapped.predicted) == "never":
      speculating = overlapped.predicted["step_speculating"]
      fired_text += f"; each step waits for the clip's decision: {speculating:.2f} s if not"
    shown.append(f"overlapped {silent:.2f} s (forward/backward {own:.2f} s{fired_text})" + remat)
  if alone is not None:
    shown.append(f"plain {alone:.2f} s")
  shown = ", ".join(shown)
  predicted = f" (predicted step: {shown})" if shown else ""
  if refusal is not None:
    return False, f"step    plain: {refusal}"
  if mode == "off":
    return False, f"step    plain (--overlap off){predicted}"
  if mode == "on":
    return True, f"step    overlapped (--overlap on){predicted}"
  if silent is None or alone is None:
    return False, "step    plain: no timeline prediction to compare the overlapped step with (--overlap on forces it)"
  share, source = fired
  expected = silent if fired_s is None else (1 - share) * silent + share * fired_s
  rule = f"expected {expected:.2f} s with the clip firing in {share:.0%} of steps ({source})"
  error = jax_dos.PREDICTION_ERROR
  resident = not overlapped.elements("host") and not overlapped.elements("stream")
  if resident or (plain is not None and not plain.elements("host") and not plain.elements("stream")):
    # The plain step updates all of its state on the accelerators, or the overlapped one would: the overlapped one
    # must be faster by more than the model's error (measured on two H100s: predicted 3.15 s fired, ran 4.77 s), and
    # no tie goes to it. With all of its state resident it has no update to hide, and gains only by its stages'
    # programs (their rematerialisation, one block's weights gathered at a time): the 6.7B GPT on fsdp=2, two H200s,
    # predicted 2.65 s against plain's 3.20 s, ran 1.17x the plain step (bench/results/gather_ahead-h200x2/).
    faster = expected * (1 + error) < alone
    keeps = "the overlapped plan keeps all the state on the accelerator" if resident else "the plain step keeps all"
    rule += f"; {keeps}{'' if resident else ' the state resident'}: the overlapped one must gain more than the"
    rule += f" predictions' {error:.0%}"
  else:
    tie = fired_s is not None and fired_s <= alone * (1 + error)
    faster = silent < alone and (expected < alone or tie)
    if tie and fired_s > alone:
      rule += f", fired within the predictions' {error:.0%} of plain: a tie"
  return faster, f"step    {'overlapped' if faster else 'plain'} (--overlap auto) (predicted step: {shown}; {rule})"
