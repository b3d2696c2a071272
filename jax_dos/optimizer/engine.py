"""The eager engine: runs one :class:`~jax_dos.plan.Plan` outside ``jit``.

Per step, everything is issued up front and waited on as late as possible:

1. the step scalars ``[-lr, 1 - b1**t, 1 - b2**t, grad_scale]`` (tiny jitted call);
2. gradients of host subgroups are copied to fresh ``pinned_host`` buffers
   (asynchronous ``device_put``; float32 or bfloat16 as they are);
3. all resident (``device``) subgroups update in one jitted call, state donated;
4. a worker thread runs the fused host kernel subgroup by subgroup, in plan
   order, as soon as each subgroup's gradients have arrived, and sends each
   new master to the accelerator at once (for bfloat16 parameters, the
   bfloat16 copy the kernel wrote in the same pass), where the update is formed;
5. meanwhile the calling thread streams ``stream`` subgroups: asynchronous
   host-to-device copies of master/mu/nu (and of gradients flushed to the
   host, one subgroup at a time; the host buffers are then released,
   as donated ones are), the jitted update, asynchronous device-to-host copies
   of the new state, with at most ``plan.stream_slots`` subgroups in flight so
   their staging memory stays bounded.

Gradients of host subgroups that arrive already in ``pinned_host`` memory
(the gradient function's ``out_shardings``, see ``gradient_shardings``) skip
step 2. bfloat16 gradients cross PCIe as they are; the kernel widens them.

With ``delay=1`` (after ``delay_warmup`` normal steps) host subgroups are
updated one step late, as ZeRO-Offload's delayed parameter update: the update
returned at step ``t`` takes their parameters to the masters of step ``t - 1``
(already on the host), and the host kernel for step ``t``'s gradients runs in
the background, overlapping the caller's next forward/backward pass. The next
``update`` (or :func:`wait_for_host_updates`, which checkpointing calls) waits
for it. With ``delay_predict="moments"`` the kernel also writes, in the same
pass, the weights one more step with the new moments would give
(``adam_math.predict_next``); those go to the accelerator instead of the
stale masters. With ``delay_predict="gradient"`` the worker sends, right after
each subgroup's kernel, copies of its new state to the accelerator, and the
next ``update`` takes AdamW's step there with the fresh gradients: undelayed
AdamW's weights, the exact step still on the host (``step_ahead.py``).

With ``write_behind`` the numbers stay optax's and only the writing of host
subgroups' state is deferred: the kernel first computes each subgroup's new
weights without storing the state (16 of the 28 bytes a parameter it moves),
and ``update`` returns once those are on their way; a second pass with the
same arithmetic writes master, mu and nu in the background, overlapping the
caller's next forward/backward pass.

The mechanics are ``jax_dos.paths``' (the overlapped step runs the same ones):
``paths.host`` (gradients to the host, the kernel over a subgroup's shards,
the new weights sent), ``paths.stream`` (copy in, step, copy back, the slots)
and ``device_steps.update_on_device`` per ``Plan.resident_call_leaves``; this
module drives them. Jitted functions are cached by jax per input signature,
so a plan compiles once. Host state is updated in place: ``update`` consumes the state passed to
it, like a donated argument. A registry of what each host buffer last held
turns accidental reuse of a consumed state into a clear error.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos import trace
from jax_dos.core import adam_math
from jax_dos.kernels import host_kernels
from jax_dos.memory import kinds as memory
from jax_dos.optimizer import device_steps
from jax_dos.optimizer.paths import host, stream
from jax_dos.optimizer.step_ahead import StepAhead
from jax_dos.planning.plan import MEMORY_KIND, Plan


class _WriteRegistry:
  """Remembers, per host state buffer, the step count it now holds.

  A buffer's finalizer only queues its id (``SimpleQueue.put`` is reentrant): a collection that an allocation under
  the lock triggers may run finalizers in the thread holding it. The next check drops the queued ids first, before
  a new buffer could reuse one.
  """

  def __init__(self):
    self._step: dict[int, int] = {}
    self._lock = threading.Lock()
    self._gone: queue.SimpleQueue[int] = queue.SimpleQueue()

  def check_and_mark(self, arrays: Sequence[jax.Array], count: int) -> None:
    with self._lock:
      while not self._gone.empty():
        self._step.pop(self._gone.get_nowait(), None)
      for a in arrays:
        held = self._step.get(id(a))
        if held is not None and held != count:
          raise ValueError(
            "this optimizer state was already consumed by an earlier update (its host buffers are"
            f" updated in place and now hold step {held}, but the state says step {count}). Pass the"
            " state returned by the latest update."
          )
      for a in arrays:
        if id(a) not in self._step:
          weakref.finalize(a, self._gone.put, id(a))
        self._step[id(a)] = count + 1


_REGISTRY = _WriteRegistry()


class _Background:
  """Host-kernel workers still running, one per engine at most (delayed ones outlive their ``update``).

  A thread per update, not the overlapped step's ``job_thread.JobThread``: an eager engine re-raises a worker's
  error at the next wait and stays usable for the next ``update``, where a failed ``JobThread`` skips every later
  job until its step is rebuilt. The work the thread does is the shared host path's (``paths.host``)."""

  def __init__(self):
    self._jobs: dict[int, tuple[threading.Thread, list[BaseException]]] = {}
    self._lock = threading.Lock()

  def start(self, owner: object, target, *args) -> None:
    errors: list[BaseException] = []
    thread = threading.Thread(target=target, args=(*args, errors), name="jax_dos-host", daemon=True)
    with self._lock:
      self._jobs[id(owner)] = (thread, errors)
    thread.start()

  def check(self, owner: object) -> None:
    """Re-raises (after joining it) the error of ``owner``'s job if it has failed; else returns at once."""
    with self._lock:
      job = self._jobs.get(id(owner))
    if job is not None and job[1]:
      self.wait(owner)

  def wait(self, owner: object | None = None) -> None:
    """Joins the job of ``owner`` (all jobs if ``None``); re-raises the first error."""
    with self._lock:
      keys = list(self._jobs) if owner is None else [id(owner)] if id(owner) in self._jobs else []
      jobs = [self._jobs.pop(k) for k in keys]
    errors = []
    for thread, errs in jobs:
      thread.join()
      errors += errs
    if errors:
      raise errors[0]


_BACKGROUND = _Background()


def wait_for_host_updates() -> None:
  """Blocks until every delayed or written-behind host update has written its state (else a no-op).

  With ``delay=1`` or ``write_behind=True`` the host part of the state
  returned by ``update`` is still being written when ``update`` returns; call
  this before reading it (the checkpoint manager and the optax state
  converters do).
  """
  _BACKGROUND.wait()


class Engine:
  """Eager execution of one plan for one parameter-tree signature."""

  def __init__(
    self,
    hyper: adam_math.AdamHyper,
    plan: Plan,
    decay: Sequence[bool],
    delay: int,
    delay_warmup: int,  # no default: interleaved_adam's (10) is the only one
    delay_predict: str | None = None,
    write_behind: bool = False,
  ):
    self.hyper = hyper
    self.plan = plan
    self.decay = tuple(decay)
    self.delay, self.delay_warmup = delay, delay_warmup
    self.delay_predict = delay_predict if delay else None  # None, "moments" or "gradient"
    self.write_behind = bool(write_behind)
    self.leaf_placement = plan.leaf_placements()
    # resident leaves, per jitted call (Plan.resident_calls)
    self.resident_calls = [list(leaves) for leaves in plan.resident_call_leaves()]
    self._kernel = host.Kernel(hyper, self.decay)
    # host leaf -> the copy of its master the kernel writes for the accelerator: bfloat16 for bfloat16 params;
    # with delay_predict="moments", float32 for the others (then it holds predictions in delayed steps)
    self._lows: dict[int, jax.Array] = {}
    self._lows_hold: tuple | None = None  # (weak refs to the masters, step, predicted) the copies were written for
    self.ahead = StepAhead(hyper, plan, decay) if self.delay_predict == "gradient" else None

  def place_state(self, leaves: list[jax.Array]) -> list[jax.Array]:
    """Moves state leaves into the memory kinds this plan wants (after a restore, say)."""
    return [
      a if memory.memory_kind(a) == MEMORY_KIND[p] else memory.copy_in(a, MEMORY_KIND[p], a.dtype)
      for a, p in zip(leaves, self.leaf_placement)
    ]

  def update(
    self, grads, masters, mus, nus, params, count, grad_scale=1.0, new_params: bool = False
  ) -> tuple[list, list, list, list, jax.Array]:
    """One step. All arguments are flat lists of leaves (``count`` and ``grad_scale`` scalars).

    Returns ``(updates, masters, mus, nus, count)``; with ``new_params`` the
    first list holds the new parameters instead (each new master cast to its
    parameter's dtype) and ``params`` are consumed like donated arguments.
    """
    with trace.span("wait.previous"):
      _BACKGROUND.wait(self)  # last step's delayed host update, if any
    plan, hyper = self.plan, self.hyper
    streamed = [i for s in plan.indices("stream") for i in plan.subgroups[s]]
    if any(lst[i].is_deleted() for lst in (masters, mus, nus) for i in streamed):
      raise ValueError(
        "this optimizer state was already consumed by an earlier update (its streamed subgroups' host"
        " buffers were released when they were copied to the accelerator). Pass the state returned by the"
        " latest update."
      )
    masters, mus, nus = (self.place_state(x) for x in (masters, mus, nus))
    n = len(grads)
    updates: list[Any] = [None] * n  # or the new parameters, with new_params
    new = [list(masters), list(mus), list(nus)]

    step = int(count)
    # The count as an uncommitted scalar: one restored by a checkpoint is committed to one device, and the scalars
    # must go where the gradient scale and the state are (a mesh).
    count = jnp.asarray(step, jnp.int32)
    host_leaves = [i for s in plan.indices("host") for i in plan.subgroups[s]]
    with trace.span("host.grads_d2h"):
      host_grads = host.gradients(grads, masters, host_leaves)  # checks them: a refused call consumes nothing
    for i in host_leaves:
      _REGISTRY.check_and_mark((masters[i], mus[i], nus[i]), step)
    scalars = device_steps.scalars(hyper, count, grad_scale)

    for dev_leaves in self.resident_calls:
      with trace.span("device.dispatch"):
        leaves = [[lst[i] for i in dev_leaves] for lst in (grads, masters, mus, nus, params)]
        outs = device_steps.update_on_device(*leaves, scalars, hyper, tuple(self.decay[i] for i in dev_leaves),
                                             new_params)  # fmt: skip
        self._scatter(dev_leaves, outs, updates, new)

    delayed = bool(host_leaves) and self.delay > 0 and step >= self.delay_warmup
    predict = delayed and self.delay_predict == "moments"
    step_ahead = delayed and self.delay_predict == "gradient"
    lows = self._low_copies(host_leaves, masters, mus, nus, params, step, delayed, scalars)
    next_scalars = device_steps.scalars(hyper, device_steps.increment(count)) if predict else None
    reading: dict[int, jax.Array] = {}
    if step_ahead:
      # The accelerator steps from the state after step t - 1; the kernel for step t runs in the background.
      reading = self.ahead.step(host_leaves, grads, masters, mus, nus, lows, params, scalars, step, updates,
                                new_params)  # fmt: skip
    elif delayed:
      # Parameters go to the masters as they are now (step t - 1); the kernel for step t runs in the background.
      reading = self._updates_from_masters(host_leaves, masters, lows, params, updates, new_params)
    if host_leaves:
      hold = ([weakref.ref(masters[i]) for i in lows], step + 1, predict)
      params_out = threading.Event() if self.write_behind else None
      args = (host_grads, masters, mus, nus, lows, params, scalars, next_scalars, updates, not delayed, new_params)
      args += (reading, hold, params_out, step + 1 if step_ahead else None)
      _BACKGROUND.start(self, self._host_worker, *args)
    self._stream(plan, hyper, masters, mus, nus, grads, params, scalars, updates, new, new_params)
    with trace.span("wait.host"):
      if host_leaves and self.write_behind:
        params_out.wait()  # the new weights are on their way; the state is being written behind
        _BACKGROUND.check(self)
      elif not delayed:
        _BACKGROUND.wait(self)
    return updates, new[0], new[1], new[2], device_steps.increment(count)

  def _low_copies(self, leaves, masters, mus, nus, params, step, synced, scalars) -> dict[int, jax.Array]:
    """The copies of the masters of ``leaves`` the kernel writes for the accelerator (host buffers the engine owns).

    bfloat16 for bfloat16 parameters, so that 2 bytes a parameter, not 4,
    cross to the accelerator; with ``delay_predict="moments"`` or ``write_behind``
    float32 for the others (predictions, or weights sent before the masters
    are written). With ``synced`` (a delayed step) they must hold
    what this step hands the accelerator: the current masters, or with
    ``delay_predict="moments"`` their prediction with this step's ``scalars``. Made
    here unless this engine's last step wrote just that for these very buffers.
    """
    floats = self.delay_predict == "moments" or self.write_behind
    wanted = [i for i in leaves if params[i].dtype == jnp.bfloat16 or floats]
    dtype = lambda i: jnp.bfloat16 if params[i].dtype == jnp.bfloat16 else jnp.float32  # noqa: E731
    missing = [i for i in wanted if i not in self._lows]
    self._lows.update(zip(missing, memory.zeros_like_each([(masters[i], dtype(i)) for i in missing])))
    lows = {i: self._lows[i] for i in wanted}
    held, predict = self._lows_hold, self.delay_predict == "moments"
    current = held is not None and held[1] == step and held[2] == predict and len(held[0]) == len(wanted)
    current = current and all(r() is masters[i] for r, i in zip(held[0], wanted))
    if self.ahead is not None:  # bfloat16 copies of mu and nu too (all of ``wanted`` are bfloat16 here)
      self.ahead.prepare(wanted, masters, mus, nus, refresh=synced and not current)
    if synced and not current:
      shards = [(i, q) for i in wanted for q in zip(*(memory.shards(a) for a in (lows[i], masters[i], mus[i], nus[i])))]
      if predict:
        hyper = self.hyper
        host_kernels.predict_many(
          [q for _, q in shards], [self.decay[i] for i, _ in shards], eps=hyper.eps, eps_root=hyper.eps_root,
          weight_decay=hyper.weight_decay, scalars=np.asarray(scalars),
        )  # fmt: skip
      else:
        for _, (low, master, _, _) in shards:
          host_kernels.round_to_bf16(low, master)
    self._lows_hold = None  # until this step's kernel has written them
    return lows

  @staticmethod
  def _updates_from_masters(leaves, masters, lows, params, updates, new_params=False) -> dict[int, jax.Array]:
    """Sends the masters of ``leaves`` (their bfloat16 copies where made) to the accelerator; forms each update there.

    The update is ``cast(master) - param``; with ``new_params`` the output is
    ``cast(master)`` itself, written into the old parameter's buffer. One
    jitted call per subgroup. Returns the outputs by leaf: once one is ready,
    its transfer is done and its host buffers may be written again. No
    reference to the transferred copies is kept: each is freed as soon as its
    output is made, not when a (delayed) kernel gets round to dropping it (it
    would hold accelerator memory through the next forward/backward pass).
    """
    sent = host.send([lows.get(i, masters[i]) for i in leaves], [params[i] for i in leaves])
    olds = [params[i] for i in leaves]
    outs = device_steps.assign(olds, sent) if new_params else device_steps.updates_from_masters(sent, olds)
    for i, out in zip(leaves, outs):
      updates[i] = out
    return dict(zip(leaves, outs))

  def _stream(self, plan, hyper, masters, mus, nus, grads, params, scalars, updates, new, new_params) -> None:
    """Streams the ``stream`` subgroups (``paths.stream``), at most ``plan.stream_slots`` in flight."""
    copies = stream.CopiesBack()
    for s in plan.indices("stream"):
      idx = list(plan.subgroups[s])
      while len(copies) >= plan.stream_slots:
        copies.wait_oldest()
      with trace.span("stream.dispatch"):
        old = [[lst[i] for i in idx] for lst in (masters, mus, nus)]
        state = stream.copy_in(old)
        memory.free_groups(old)  # once its copy is done: host memory holds one copy of the state
        outs, back, _ = stream.step([grads[i] for i in idx], state, [params[i] for i in idx], scalars, hyper,
                                    tuple(self.decay[i] for i in idx), copies, new_params=new_params)  # fmt: skip
        self._scatter(idx, (outs, *back), updates, new)

  @staticmethod
  def _scatter(idx, outs, updates, new) -> None:
    u, m32, m1, m2 = outs
    for j, i in enumerate(idx):
      updates[i] = u[j]
      new[0][i], new[1][i], new[2][i] = m32[j], m1[j], m2[j]

  def _host_worker(
    self, host_grads, masters, mus, nus, lows, params, scalars, next_scalars, updates, send, new_params, reading, hold,
    params_out, ahead_step, error,
  ):  # fmt: skip
    """Runs the host kernel subgroup by subgroup; with ``send``, ships each new master and forms its update.

    Never writes a host buffer that a transfer still reads: before each
    subgroup it waits for ``reading``'s transfers of that subgroup (the
    delayed path's), and before returning for its own, so no step leaves a
    transfer for the next one to wait on. It does not wait for one
    subgroup's transfers before the next subgroup's kernel: they read other
    buffers, and the transfers queue behind streamed subgroups' on PCIe
    (waiting cost a third of the host path's time in a mixed plan, H200). Then records ``hold``: what the
    bfloat16 copies now hold. With ``params_out`` (write-behind) the first pass
    writes only the new weights and sends them, sets ``params_out``, and a
    second pass writes the state. With ``ahead_step`` (``delay_predict="gradient"``)
    it sends each subgroup's new state ahead to the accelerator for that step's ``update``.
    """
    plan = self.plan

    def arrays(with_low):  # each leaf's buffers in the kernel's order: the copies for the accelerator first pass only
      def of(i):
        out = (host_grads[i], masters[i], mus[i], nus[i])
        if with_low and i in lows:
          out += (lows[i], *(self.ahead.moment_copies.get(i, ()) if self.ahead else ()))
        return out

      return of

    try:
      scalars_np = np.asarray(scalars)
      next_np = None if next_scalars is None else np.asarray(next_scalars)
      sending: list[jax.Array] = []
      sent_ahead: dict[int, tuple] = {}
      for s in plan.indices("host"):
        leaves = plan.subgroups[s]
        with trace.span("host.wait_reading"):
          jax.block_until_ready([reading.pop(i) for i in leaves if i in reading])
        for i in [i for i, x in reading.items() if x.is_ready()]:
          del reading[i]  # copied: drop the accelerator copy now, not while the next forward/backward needs memory
        with trace.span("host.wait_grads"):
          jax.block_until_ready([host_grads[i] for i in leaves])
        with trace.span("host.kernel"):
          self._kernel.step(leaves, arrays(True), scalars_np, next_np, write_state=params_out is None)
        if send:
          with trace.span("host.send"):
            sending += self._updates_from_masters(leaves, masters, lows, params, updates, new_params).values()
        if ahead_step is not None and set(leaves) <= self.ahead.sent_ahead(params):
          with trace.span("host.send_ahead"):
            sent_ahead.update(self.ahead.send(leaves, masters, mus, nus, lows))
      if params_out is not None:
        params_out.set()
        for s in plan.indices("host"):  # the state, behind: same inputs, same arithmetic, the copies left alone
          with trace.span("host.kernel_state"):
            self._kernel.step(plan.subgroups[s], arrays(False), scalars_np)
      with trace.span("host.wait_sent"):
        jax.block_until_ready([*reading.values(), *sending, *sent_ahead.values()])
      self._lows_hold = hold
      if ahead_step is not None:
        self.ahead.keep([i for s in plan.indices("host") for i in plan.subgroups[s]], masters, ahead_step, sent_ahead)
    except BaseException as e:  # re-raised on the calling thread
      error.append(e)
    finally:
      if params_out is not None:
        params_out.set()
