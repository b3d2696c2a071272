"""The job's processes as the training script sees them: which one speaks, where they wait for each other, what they
agree on (one process: all of it trivially)."""

from __future__ import annotations

import sys

import jax
import numpy as np

from train.flags import Flags


def warn(msg: str) -> None:
  """One line on stderr, even with --quiet: something about the run's checkpoints the user must know (process 0)."""
  if primary():
    print(msg, file=sys.stderr, flush=True)


def primary() -> bool:
  """Whether this is process 0 of the job: the one that prints, logs and plots."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Every process of the job waits here for the others (nothing in a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(f"train.gpt {name}")


def everywhere(flag: bool) -> bool:
  """Whether ``flag`` holds in every process of the job (a collective with several processes)."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).all())


def say(args: Flags, msg: str) -> None:
  """A line above the progress bar (process 0, unless --quiet)."""
  if not args.quiet and primary():
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
