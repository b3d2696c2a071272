"""Where the state's bytes live: memory kinds, the host's RAM, XLA's pinned pool and pinned memory of our own, and
copies between them.

From the ground up, each module importing only those below it (and the root's ``job_thread``, ``hand_off`` and
``parallel_launch``)::

    kinds.py         memory kinds: where an array lives, and moving it there (eagerly or traced)
    host_ram.py      the host's RAM as /proc/meminfo reports it, and the headroom a run keeps beside its state
    pinned_arena.py  pinned host memory outside XLA's pool: mappings of our own, cut into pinned_host arrays
    cpu_client.py    XLA's CPU client with several devices in a process: enough pool threads (PJRT_NPROC)
    pinned_pool.py   XLA's pinned host pool: its cap, the resident set it makes, the check that a request fits
    host_copies.py   copies of host arrays by all cores, at DRAM speed
    copy_out.py      copies from the accelerator into a PinnedArena's arrays
    configure.py     configure_process: what XLA reads when its backend starts, set by one explicit call

It exports nothing; each module is imported by name (``jax_dos.memory.kinds``, ...).
"""
