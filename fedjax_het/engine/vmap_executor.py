"""The vmap executor: a group's participants in chunks of similar work, each chunk one jitted call of
`run_client_rows` vmapped over its clients (the interface: `engine.executor`)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import ClientProgram, Evaluation, has_per_client, map_per_client, per_client_axes
from fedjax_het.engine.chunks import Chunk, plan_chunks, width_ladder
from fedjax_het.engine.client import RowsOf, client_statistics_rows, run_client_rows, score_client_rows
from fedjax_het.engine.executor import Executor
from fedjax_het.engine.groups import Group, fold_in_each
from fedjax_het.engine.plan import statistics_key, step_counts
from fedjax_het.engine.sharding import device_zeros, to_device, to_host
from fedjax_het.engine.streaming import ResidentClients, StreamedClients, host_states
from fedjax_het.errors import ConfigError


def take(tree: Any, idx) -> Any:
  """Rows `idx` of every leaf's leading axis (indices past the end clip to the last row)."""
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), tree)


def vmap_broadcast(fn: Callable, broadcast: Any, idx) -> Callable:
  """`fn(*args, broadcast)` vmapped over the leading axis of args, each call reading `for_client(broadcast, i)` for
  its slot's client i (idx [S]): the broadcast's `PerClient` parts are gathered at idx and vmapped with the slots,
  the rest shared."""
  if not has_per_client(broadcast):
    return lambda *args: jax.vmap(lambda *a: fn(*a, broadcast))(*args)
  gathered = map_per_client(lambda v: take(v, idx), broadcast)
  return lambda *args: jax.vmap(lambda b, *a: fn(*a, b), in_axes=(per_client_axes(broadcast),) + (0,) * len(args))(
      gathered, *args)


def compiled_peak(lowered) -> Optional[int]:
  """The peak device bytes XLA's memory analysis gives a lowered call once compiled (arguments, outputs and
  temporaries), or None where the backend gives none."""
  stats = lowered.compile().memory_analysis()
  if stats is None:
    return None
  peak = getattr(stats, 'peak_memory_in_bytes', 0)
  return int(peak or stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)


class VmapExecutor(Executor):
  """A group's participants in chunks (`engine.chunks`): each chunk is one jitted call of `run_client_rows`
  vmapped over its clients, which read their rows from the group's flat store on the device (no padded copy) and
  loop for as many steps and passes as the chunk's largest client needs. Chunk widths come from a fixed ladder up
  to `chunk_size` (0: `DEFAULT_MAX_WIDTH`), so the compiled programs are a few per group and phase whatever the
  number of clients."""

  DEFAULT_MAX_WIDTH = 256
  # A representation or scoring pass of a chunk holds at most this many clients' full passes of rows: wide chunks
  # take fewer rows per client per pass, so that a pass's activations stay as large as a narrow chunk's.
  PASSES_IN_FLIGHT = 32

  def __init__(self, eval_batch_size: int, chunk_size: int = 0, scan_unroll: int = 1, num_devices: int = 1,
               placement: Callable[[Any], Any] = jax.device_put, memory_budget: Optional[int] = None,
               stream: bool = False):
    super().__init__(eval_batch_size)
    self.chunk_size, self.scan_unroll, self.num_devices = chunk_size, scan_unroll, num_devices
    # Client states and rows on the host, each chunk's copied to the device for its call (`stream_clients`).
    self.stream = stream
    self.placement = placement  # how a store's rows reach the device (replicated over a client mesh)
    self.memory_budget = memory_budget
    self.last_plan: dict = {}  # (name, group) -> the chunk plan of the latest call (benchmarks read it)
    self.widest: dict = {}  # (group, phase) -> its widest chunk under the memory budget (`budget_width`)
    self.analysis: dict = {}  # group -> XLA's peaks of its latest budget analysis (benchmarks read it)

  def max_width(self, g: Optional[Group] = None, phase: Optional[int] = None) -> int:
    """The widest chunk: `chunk_size`, else what the memory budget allows group g's rounds of `phase`
    (`budget_width`, once one has run; without a phase, the narrowest of its phases run so far), else
    DEFAULT_MAX_WIDTH; a multiple of the mesh's devices."""
    known = [w for (gi, p), w in self.widest.items() if g is not None and gi == g.spec.index
             and (phase is None or p == phase)]
    width = self.chunk_size or (min(known) if known else self.DEFAULT_MAX_WIDTH)
    return max(width // self.num_devices, 1) * self.num_devices

  def plan(self, name: str, g: Group, work: np.ndarray, phase: Optional[int] = None) -> list[Chunk]:
    """The chunks of participants with `work` (`chunks.plan_chunks`), recorded as the latest plan of `name`."""
    chunks = plan_chunks(work, self.max_width(g, phase), multiple=self.num_devices)
    self.last_plan[(name, g.spec.index)] = (np.asarray(work), chunks)
    return chunks

  def budget_width(self, g: Group, lower: Callable[[int], Any]) -> int:
    """The widest ladder width whose compiled call fits `memory_budget` bytes on the device, from XLA's memory
    analysis of the call compiled at the two narrowest widths (`lower(width)`: the call lowered at that width):
    its peak, resident arrays included, grows linearly with the width; a group no wider than the narrowest width
    has only that one compiled and checked. Without a budget (or where the backend reports no analysis)
    DEFAULT_MAX_WIDTH; with `chunk_size` set, that."""
    if self.chunk_size or self.memory_budget is None:
      return self.max_width()
    ladder = width_ladder(self.DEFAULT_MAX_WIDTH, self.num_devices)
    if len(ladder) < 2:
      return ladder[0]
    narrow, next_up = ladder[-1], ladder[-2]
    widths = (narrow,) if g.stacked_size <= narrow else (narrow, next_up)
    peaks = [compiled_peak(lower(w)) for w in widths]
    if None in peaks:
      return self.max_width()
    per_client = max((peaks[-1] - peaks[0]) / (next_up - narrow), 1.0) if len(peaks) > 1 else None
    self.analysis[g.spec.index] = {'widths': widths, 'peaks': tuple(peaks), 'per_client': per_client}
    if peaks[0] > self.memory_budget:
      gib = lambda b: f'{b / 2**30:.4g} GiB ({b} bytes)'  # the command line names the budget in GiB
      raise ConfigError(
          f'ExecutionConfig.memory_budget={gib(self.memory_budget)}: a round of group {g.arch!r} needs '
          f'{gib(peaks[0])} on the device with {narrow} client(s) per call (its clients\' states and rows '
          f'included). Fix: a larger ExecutionConfig.memory_budget, or fewer clients or a smaller model in that '
          f'group.')
    if per_client is None:
      return narrow
    fits = narrow + int((self.memory_budget - peaks[0]) // per_client)
    return max(w for w in ladder if w <= fits)

  def pass_rows(self, width: int) -> int:
    """Rows per client in one representation or scoring pass of a chunk of `width` clients."""
    return max(1, min(self.eval_batch_size, self.eval_batch_size * self.PASSES_IN_FLIGHT // width))

  def widths(self, slots: int, g: Optional[Group] = None, phase: Optional[int] = None) -> tuple[int, ...]:
    """The ladder widths a call of group g over `slots` slots can use (`chunks.width_ladder` up to its
    `max_width`; none wider than the slots, but the narrowest)."""
    ladder = width_ladder(self.max_width(g, phase), self.num_devices)
    return tuple(w for w in ladder if w <= slots or w == ladder[-1])

  def _functions(self, name: str, g: Group, phase: int, slots: int, make: Callable, warm: Callable) -> dict:
    """width -> the jitted function `name` of group g in `phase` over that many clients (`make(width)`), for every
    ladder width a call over `slots` slots can use: each is made and called once with empty slots (`warm(fn,
    width)`, which computes nothing that counts), so every program a phase runs compiles in its first round, never
    later."""
    def build():
      fns = {}
      for width in self.widths(slots, g, phase if name == 'vmap_update' else None):
        fns[width] = self.jitted(name, g, phase, width, make)
        warm(fns[width], width)
      return fns
    return self.compiled(name, g.spec.index, phase, slots, make=build)

  def jitted(self, name: str, g: Group, phase: int, width: int, make: Callable) -> Callable:
    """The one jitted function `name` of group g in `phase` at `width` (`make(width)`), whatever the round's slot
    count: a call compiles it once, and the memory analysis's compilation (`budget_width`) is the one its calls
    reuse (JAX caches executables per jitted function)."""
    return self.compiled(name + '_jit', g.spec.index, phase, width, make=lambda: jax.jit(
        make(width), donate_argnums=(0, 1) if name == 'vmap_update' else 0))

  def run(self, g, program, phase, stacked, slot_idx, broadcast, key):
    slots = len(slot_idx)
    local = np.asarray(slot_idx)[np.asarray(slot_idx) < g.size]
    n = g.train_sizes[local]
    steps = step_counts(program, g.rows.n_max, n)  # [participants, stages]
    statistics_rows = np.asarray(program.training.statistics_rows(n)) if program.trained is not None else n * 0
    source = (StreamedClients(g, g.rows, host_states(stacked), self.placement) if self.stream
              else ResidentClients(g, g.rows, stacked, self.placement))

    def empty(width):  # a call over `width` empty slots: nothing trains, nothing is written
      idx = np.full(width, g.stacked_size, np.int32)
      return (*source.inputs(idx, width), to_device(idx), to_device(np.full(width, slots, np.int32)), g.stacked_ids,
              broadcast, key, device_zeros(steps.shape[1], np.int32), np.int32(0))

    def one_slot():
      first, store, offsets, counts, idx, _, *rest = empty(1)
      return first, store, offsets, counts, idx, *rest

    shapes = self.compiled('vmap_buffers', g.spec.index, phase, slots, make=lambda: jax.eval_shape(
        self._make_update(g, program, 1, train=False), *one_slot())[1:])  # a slot's results
    zeros = lambda: jax.tree.map(lambda s: device_zeros((slots,) + s.shape[1:], s.dtype), shapes)

    def warm(fn, width):
      first, store, *rest = empty(width)
      source.written(None, fn(first, zeros(), store, *rest)[0])

    make = lambda width: self._with_buffers(self._make_update(g, program, width))
    if (g.spec.index, phase) not in self.widest:  # the phase's first round: the widest chunk its memory allows
      self.widest[(g.spec.index, phase)] = self.budget_width(g, lambda width: self.jitted(
          'vmap_update', g, phase, width, make).lower(empty(width)[0], zeros(), *empty(width)[1:]))
    fns = self._functions('vmap_update', g, phase, slots, make, warm)
    out = zeros()
    chunks = self.plan('train', g, steps.sum(1), phase)
    calls = [(chunk, self._slots(local[chunk.positions], chunk.width, g.stacked_size)) for chunk in chunks]
    ahead = source.prefetch(calls[0][1], calls[0][0].width) if calls else None
    for c, (chunk, idx) in enumerate(calls):
      first, store, offsets, counts = ahead
      first = source.states() if first is None else first
      dest = self._slots(chunk.positions, chunk.width, slots)
      trips = to_device(steps[chunk.positions].max(0, initial=0), np.int32)
      passes = -(-int(statistics_rows[chunk.positions].max(initial=0)) // self.pass_rows(chunk.width))
      new, out = fns[chunk.width](first, out, store, offsets, counts, to_device(idx), to_device(dest),
                                  g.stacked_ids, broadcast, key, trips, np.int32(passes))
      if c + 1 < len(calls):  # the next chunk's inputs travel while this one computes
        ahead = source.prefetch(calls[c + 1][1], calls[c + 1][0].width)
      source.written(idx, new)
    uploads, losses = out
    return source.states(), uploads, losses

  @staticmethod
  def _with_buffers(core: Callable) -> Callable:
    """`core` (a chunk's update) writing its uploads and losses into slot-ordered buffers at `dest` (positions past
    them: dropped), so that a round assembles its results without further programs."""
    def update(stacked, buffers, store, offsets, counts, slot_idx, dest, client_ids, broadcast, key, trips, passes):
      stacked, uploads, losses = core(stacked, store, offsets, counts, slot_idx, client_ids, broadcast, key, trips,
                                      passes)
      return stacked, jax.tree.map(lambda b, u: b.at[dest].set(u, mode='drop'), buffers, (uploads, losses))
    return update

  @staticmethod
  def _slots(local: np.ndarray, width: int, empty: int) -> np.ndarray:
    """A chunk's client indices, padded to its width with `empty` (past the stack: an empty slot)."""
    return np.concatenate([local, np.full(width - len(local), empty)]).astype(np.int32)

  def _make_update(self, g: Group, program: ClientProgram, width: int, train: bool = True):
    """A chunk's update: (stacked states, or with `stream` the chunk's own, store, offsets, counts, slot_idx,
    client_ids, broadcast, key, trips, passes) -> (the same states updated, uploads, losses); train=False: without
    the local steps, the same shapes (`run_client_rows`)."""
    num_rows, unroll, chunk, stream = g.rows.n_max, self.scan_unroll, self.pass_rows(width), self.stream

    def update(states, store, offsets, counts, slot_idx, client_ids, broadcast, key, trips, passes):
      clients = states if stream else take(states, slot_idx)
      ids = jnp.take(client_ids, slot_idx, mode='clip')
      rngs = fold_in_each(key, ids)
      one = lambda c, off, cnt, k, b: run_client_rows(program, g.model, c, RowsOf(store, off, cnt, num_rows), b, k,
                                                      trips, passes, chunk, unroll, train)
      new, uploads, losses = vmap_broadcast(one, broadcast, slot_idx)(clients, offsets, counts, rngs)
      real = slot_idx < g.size
      uploads = jax.tree.map(lambda u: jnp.where(real.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros((), u.dtype)),
                             uploads)  # empty slots zero, in the upload's own dtype (a bool stays bool)
      if not stream:
        new = jax.tree.map(lambda a, b: a.at[slot_idx].set(b, mode='drop'), states, new)
      return new, uploads, jnp.where(real, losses, 0.0)
    return update

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    blocks = np.array([test.index(i) for i in range(g.size)])
    counts = test.sizes[blocks]
    source = (StreamedClients(g, test.rows, host_states(stacked, copy=False), self.placement, blocks, test.shared)
              if self.stream
              else ResidentClients(g, test.rows, stacked, self.placement, blocks))

    def args(positions, width):
      idx = self._slots(positions, width, g.stacked_size)
      states, store, offsets, row_counts = source.inputs(idx, width)
      return (store, offsets, row_counts, to_device(idx), to_device(self._slots(positions, width, g.size)),
              broadcast, states)

    scores = device_zeros((g.size, len(evaluation.names)), np.int32)

    def warm(fn, width):
      fn(device_zeros(scores.shape, np.int32), *args(np.zeros(0, np.int32), width), np.int32(0))
    fns = self._functions(f'vmap_eval_{which}', g, phase, g.size, lambda width: self._scores_into(
        self._make_eval(evaluation, test.rows.n_max, width)), warm)
    for chunk in self.plan(f'eval_{which}', g, -(-counts // self.eval_batch_size)):
      passes = -(-int(counts[chunk.positions].max(initial=0)) // self.pass_rows(chunk.width))
      scores = fns[chunk.width](scores, *args(chunk.positions, chunk.width), np.int32(passes))
    return to_host(scores)

  @staticmethod
  def _scores_into(core: Callable) -> Callable:
    def into(scores, store, offsets, counts, slot_idx, dest, broadcast, stacked, passes):
      return scores.at[dest].set(core(stacked, store, offsets, counts, slot_idx, broadcast, passes), mode='drop')
    return into

  def _make_eval(self, evaluation: Evaluation, num_rows: int, width: int):
    chunk, stream = self.pass_rows(width), self.stream

    def evaluate(states, store, offsets, counts, slot_idx, broadcast, passes):
      one = lambda c, off, cnt, b: score_client_rows(evaluation, c, b, RowsOf(store, off, cnt, num_rows), passes,
                                                     chunk)
      clients = states if stream else take(states, slot_idx)
      return vmap_broadcast(one, broadcast, slot_idx)(clients, offsets, counts)
    return evaluate

  def statistics(self, g, evaluation, phase, stacked, broadcast, key):
    batch = min(g.spec.training.batch_size, g.rows.n_max)
    source = (StreamedClients(g, g.rows, host_states(stacked, copy=False), self.placement) if self.stream
              else ResidentClients(g, g.rows, stacked, self.placement))
    core = self._make_statistics(g, evaluation, batch)

    def args(positions, width):
      idx = self._slots(positions, width, g.stacked_size)
      states, store, offsets, counts = source.inputs(idx, width)
      return (store, offsets, counts, to_device(idx), g.stacked_ids, broadcast, key, states)

    shapes = jax.eval_shape(lambda *a: core(a[-1], *a[:-1], jnp.int32(0)), *args(np.zeros(0, np.int32), 1))
    total = jax.tree.map(lambda s: device_zeros(s.shape, s.dtype), shapes)

    def warm(fn, width):
      empty_total = jax.tree.map(lambda t: device_zeros(t.shape, t.dtype), total)
      fn(empty_total, *args(np.zeros(0, np.int32), width), np.int32(0))
    fns = self._functions('vmap_statistics', g, phase, g.size, lambda width: self._sum_into(core), warm)
    for chunk in self.plan('statistics', g, -(-g.train_sizes // batch)):
      total = fns[chunk.width](total, *args(chunk.positions, chunk.width), np.int32(chunk.work))
    return total

  @staticmethod
  def _sum_into(core: Callable) -> Callable:
    def into(total, store, offsets, counts, slot_idx, client_ids, broadcast, key, stacked, passes):
      return jax.tree.map(jnp.add, total, core(stacked, store, offsets, counts, slot_idx, client_ids, broadcast, key,
                                               passes))
    return into

  def _make_statistics(self, g: Group, evaluation: Evaluation, batch: int):
    num_rows, stream, training = g.rows.n_max, self.stream, g.spec.training

    def gather(states, store, offsets, counts, slot_idx, client_ids, broadcast, key, passes):
      keys = jax.vmap(lambda c: statistics_key(key, c))(jnp.take(client_ids, slot_idx, mode='clip'))
      one = lambda c, off, cnt, k, b: client_statistics_rows(evaluation, training, c, b,
                                                             RowsOf(store, off, cnt, num_rows), passes, batch, k)
      clients = states if stream else take(states, slot_idx)
      per = vmap_broadcast(one, broadcast, slot_idx)(clients, offsets, counts, keys)
      real = slot_idx < g.size
      return jax.tree.map(lambda a: jnp.sum(jnp.where(real.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0), 0), per)
    return gather
