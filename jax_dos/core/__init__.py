"""The optimizer's data: its state, the parameter tree as it reads it, Adam's arithmetic and how the moments are
stored.

From the ground up, each module importing only those below it (and ``jax_dos.memory``'s kinds, the process's one
kernel launch ``jax_dos.parallel_launch``)::

    state.py           InterleavedAdamState: a step count and three trees mirroring the parameters
    trees.py           the parameter tree as the optimizer reads it: its leaves, Flax NNX variables in it
    partition.py       a replicated parameter's Adam state partitioned over a mesh (ZeRO-1/2 style)
    moment_formats.py  how the moments are stored: float32, bfloat16, or int8 codes with a scale per block
    adam_math.py       the AdamW arithmetic, written once, in optax.adamw's order

It exports nothing; each module is imported by name (``jax_dos.core.adam_math``, ...).
"""
