"""The update's mechanics by placement, one implementation shared by the eager engine and the overlapped step.

* resident (``"device"``): the state stays in accelerator memory; its subgroups are updated in bounded jitted calls
  (``Plan.resident_call_leaves``), each ``device_steps.update_on_device``;
* ``stream.py``: a subgroup's state copied in from pinned host memory, stepped on the accelerator, copied back, with
  at most ``plan.stream_slots`` subgroups in flight;
* ``host.py``: gradients to pinned host memory, the fused host kernel over a subgroup's shards, the new weights sent
  to the accelerator.

``jax_dos.optimizer.engine`` (one eager update) and ``jax_dos.overlap`` (the overlapped step's host and stream paths)
drive them: when each subgroup is stepped, on which thread, with which scale, and which buffers the new state goes to
are theirs; each module's docstring says where the two differ.
"""
