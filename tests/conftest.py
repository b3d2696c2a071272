"""Settings every test process and the processes it starts share."""

import os

# XLA's CPU client runs a program's per-device parts on a pool of max(cores, local devices) threads, and a part that
# reaches a collective holds its thread until its peers arrive. On a 2-core machine with 4 devices (or 2 devices in
# each of 2 processes) another program's parts can leave a collective's peer without a thread: both processes of a
# hung two-process run were found blocked dispatching in the same call, and a 4-device run timed out in a collective
# whose peer never arrived. More threads than devices leave room. Set before jax starts; inherited by subprocesses.
os.environ.setdefault("PJRT_NPROC", "16")
