"""The host kernels: AdamW fused over a subgroup's host buffers, multi-threaded (numba), updating in place.

From the ground up, each module importing only those below it (and ``jax_dos.core``; every parallel kernel launches
through the root's ``parallel_launch``, which flushes subnormals: ``subnormals``)::

    host_compact.py  the kernel for compact moments (bfloat16, or int8 with a scale per block)
    host_kernels.py  the kernels by moment format, their thread count, and their compilation cache

It exports nothing; each module is imported by name (``jax_dos.kernels.host_kernels``, ...).
"""
