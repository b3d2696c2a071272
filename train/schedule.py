"""The learning-rate schedule: its defaults by model size, the optax schedule a run follows, and a resumed run's.

Linear warm-up from 0 to the peak rate, then cosine decay to the final rate (optax's
``warmup_cosine_decay_schedule``), over four flags (:data:`SCHEDULE_FLAGS`). The defaults (module constants) are
resolved by ``train.flags``; a resumed run keeps its checkpoint's schedule (:func:`resumed_schedule`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import optax

# Learning rate per preset when --lr is not given: larger models take smaller rates, from 125M up GPT-3's (Brown et
# al. 2020, table 2.1); a Llama of 7B takes the rate of GPT-3's 6.7B, the 30B that of its 13B (OPT-30B's too).
DEFAULT_LR = {"tiny": 3e-3, "small": 1e-3, "gpt2-124m": 6e-4, "gpt2-350m": 3e-4, "gpt-1.3b": 2e-4, "gpt-2.7b": 1.6e-4,
              "gpt-6.7b": 1.2e-4, "gpt-13b": 1e-4, "gpt-30b": 1e-4, "llama-7b": 1.2e-4}  # fmt: skip
FALLBACK_LR = 2e-4
# The warm-up when --warmup is not given: min(100, decay steps / 10) for a model under LARGE_MODEL parameters,
# LARGE_WARMUP steps from there, however long the run (nanoGPT's warm-up; GPT-3 warmed up over 375M tokens). Adam's
# first steps move every weight by about the rate, and a billion-parameter model's loss cannot take that: the 6.7B
# GPT went 4.7 -> 13.9 after a step at 2.4e-6 (100 steps' warm-up, bench/results/overlapped_step_redesign-h100) and
# 6.2 -> 31 at 2e-4 (2 steps'). A run shorter than its warm-up ends with the rate still rising.
LARGE_MODEL = 10**9  # parameters: "a billion" in --help
LARGE_WARMUP = 2000
# Fine-tuning a pretrained model (--init-from), as common supervised fine-tuning recipes do (Llama 2's, Alpaca's):
# a small peak rate, a warm-up of 3 % of the steps, a cosine decay; sequences of at most 2048 tokens.
FINE_TUNE_LR = 2e-5
FINE_TUNE_WARMUP = 0.03
# The flags of the learning-rate schedule: a resumed run takes the checkpoint's values of those not given.
SCHEDULE_FLAGS = ("lr", "min_lr", "warmup", "decay_steps")


class Config(Protocol):
  """What a schedule reads of a run's config (``train.flags.TrainConfig``)."""

  lr: float
  min_lr: float
  warmup: int
  decay_steps: int
  schedule_given: tuple[str, ...]


def lr_default_text(presets: list[str]) -> str:
  """Every preset's default --lr, presets sharing a value grouped: ``tiny 0.003, ..., gpt-1.3b/gpt-13b 0.0002``."""
  groups: dict[float, list[str]] = {}
  for name in presets:
    groups.setdefault(DEFAULT_LR.get(name, FALLBACK_LR), []).append(name)
  return ", ".join(f"{'/'.join(names)} {lr:g}" for lr, names in groups.items())


class Schedule:
  """Linear warm-up from 0 to ``--lr``, then cosine decay to ``--min-lr`` at ``--decay-steps`` (the warm-up alone
  where it is as long: the run ends with the rate rising): an optax schedule (``count -> learning rate``) of a
  config's four schedule flags, read when called.

  The optimizer exists before a resumed run reads its checkpoint (the restore's template comes from the optimizer's
  plan), and the resumed run may keep the checkpoint's schedule (``train.checkpoints.restore`` returns that config,
  :func:`resumed_schedule`): :meth:`follow` gives this schedule that config before the first step, so that
  the optimizer and the log use it. No config is changed.
  """

  def __init__(self, args: Config) -> None:
    self._args = args

  def follow(self, args: Config) -> None:
    """From now on, ``args``'s schedule."""
    self._args = args

  def __call__(self, count: jax.Array | int) -> jax.Array:
    a = self._args
    if a.warmup >= a.decay_steps:  # the run ends in its warm-up
      return optax.linear_schedule(0.0, a.lr, a.warmup)(count)
    return optax.warmup_cosine_decay_schedule(0.0, a.lr, a.warmup, a.decay_steps, a.min_lr)(count)


def resumed_schedule(args: Config, saved_args: dict[str, Any]) -> tuple[Config, list[str]]:
  """``(config, lines to print)``: ``args`` with the learning-rate schedule of the run being resumed (``args`` itself,
  and no lines, where nothing changes).

  Each of ``--lr``, ``--min-lr``, ``--warmup`` and ``--decay-steps`` that this command line did not give
  (``args.schedule_given``) takes its value in ``saved_args`` (the ``args`` a checkpoint's meta holds), in a new config
  (``dataclasses.replace``): a larger ``--steps`` then trains on at the end of the same schedule instead of stretching
  it. A ``--min-lr`` not given follows a given ``--lr`` (its default, lr/10). The flags given are kept, and so is every
  flag ``saved_args`` lacks. ``SystemExit`` naming the flags where the merged schedule is inconsistent.
  """
  given = set(args.schedule_given)
  taken = {}
  for name in SCHEDULE_FLAGS:
    if name in given or (name == "min_lr" and "lr" in given) or saved_args.get(name) is None:
      continue
    if saved_args[name] != getattr(args, name):
      taken[name] = saved_args[name]
  if not taken:
    return args, []
  args = dataclasses.replace(args, **taken)
  flags = ", ".join("--" + name.replace("_", "-") for name in taken)
  if args.warmup < 0 or not 0 <= args.min_lr <= args.lr:
    raise SystemExit(
      f"error: --resume: the resumed run's {flags} and this command line's give a schedule of lr {args.lr:g} ->"
      f" {args.min_lr:g}, warm-up {args.warmup} of {args.decay_steps} steps; pass {flags} too."
    )
  return args, [
    f"resume: keeping the resumed run's learning-rate schedule ({flags} from its checkpoint): lr {args.lr:g} ->"
    f" {args.min_lr:g}, warm-up {args.warmup}, cosine to step {args.decay_steps}; pass {flags} to change it."
  ]
