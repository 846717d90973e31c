"""Executors: how a group's participants run their `ClientProgram` and how its clients are scored. Both run
exactly the program's and the evaluation's functions, so they give the same numbers.

  VmapExecutor:       `jax.vmap(run_client_rows)` over chunks of a group's participants of similar work
                      (`engine.chunks`), one jitted call each, the local steps in a loop as long as the chunk's
                      busiest client needs. The fast path on accelerators; with a client mesh, each device updates
                      its share of a chunk's slots (SPMD).
  SequentialExecutor: the host walks the participants; each runs init, its real local steps and final, each
                      jitted once per group and phase and reused. `threads` clients run at once, one host thread
                      each. The fast path on XLA:CPU, which runs convolutions inside while-loops and vmapped
                      (grouped) convolutions several times slower.
Executors cache their compiled functions per (name, group, phase); `compiled_functions()` lists them.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import (ClientProgram, Evaluation, for_client, has_per_client, map_per_client, per_client_axes,
                             prepare_evaluation, with_model, without_model)
from fedjax_het.engine.chunks import Chunk, plan_chunks, width_ladder
from fedjax_het.engine.client import (RowsOf, client_statistics_rows, run_client_rows, score_client_rows, weighted)
from fedjax_het.engine.groups import EvalSet, Group, representation_model
from fedjax_het.engine.plan import (client_keys, client_rows, count_into, even_chunk, plan_stages, represent_into,
                                    stage_key, statistics_batch, statistics_key, statistics_of_batch,
                                    statistics_order, step_counts, take_step, zero_statistics)
from fedjax_het.engine.sharding import to_host
from fedjax_het.engine.stores import DeviceRows, RowStore
from fedjax_het.errors import ConfigError

STRATEGIES = ('vmap', 'sequential')


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


def host_states(stacked: Any, copy: bool = True) -> Any:
  """Stacked client states on the host: a writable copy (a round updates its copy, never the state it was given),
  or with copy=False the arrays themselves where they are there already (for reading)."""
  return jax.tree.map(lambda a: np.array(to_host(a)) if copy else np.asarray(to_host(a)), stacked)


class ResidentClients:
  """A group's client states and rows on the device: a chunk's call receives them whole and picks its clients
  (`idx`); `blocks[i]` is the block of `rows` client i reads (default: its own)."""

  def __init__(self, g: Group, rows: RowStore, stacked: Any, placement: Callable, blocks=None):
    self.g, self.rows, self.stacked, self.placement = g, rows, stacked, placement
    self.blocks = np.arange(len(rows.n)) if blocks is None else np.asarray(blocks)

  def inputs(self, idx: np.ndarray, width: int) -> tuple:
    """(states, store, offsets, counts) of a call over slots `idx` (past the group: empty)."""
    block = self.blocks[np.minimum(idx, self.g.size - 1)]
    real = idx < self.g.size
    return (self.stacked, self.rows.device(self.placement),
            jnp.asarray(np.where(real, self.rows.offset[block], 0), jnp.int32),
            jnp.asarray(np.where(real, self.rows.n[block], 0), jnp.int32))

  def prefetch(self, idx: np.ndarray, width: int) -> tuple:
    """`inputs` made ahead of the call, the states left out (the call before it returns them)."""
    return (None,) + self.inputs(idx, width)[1:]

  def written(self, idx, states) -> None:
    """Takes the states a call returned (the whole stack)."""
    self.stacked = states

  def states(self) -> Any:
    return self.stacked


class StreamedClients(ResidentClients):
  """A group's client states and rows on the host: a chunk's call receives only its clients' states and rows,
  copied to the device (slot j's rows at j * n_max of a [width * n_max] block), and its states are copied back.
  Rows shared by every client (`shared_rows`, a global test set) stay on the device."""

  def __init__(self, g: Group, rows: RowStore, stacked: Any, placement: Callable, blocks=None,
               shared_rows: bool = False):
    super().__init__(g, rows, stacked, placement, blocks)
    self.shared_rows = shared_rows

  def inputs(self, idx: np.ndarray, width: int) -> tuple:
    pick = np.minimum(idx, self.g.stacked_size - 1)
    clients = jax.device_put(jax.tree.map(lambda a: a[pick], self.stacked))
    if self.shared_rows:
      return (clients,) + super().inputs(idx, width)[1:]
    span, host = self.rows.n_max, self.rows.rows
    x = np.zeros((width * span,) + host.x.shape[1:], host.x.dtype)
    y = np.zeros(width * span, np.int32)
    counts = np.zeros(width, np.int32)
    for j, i in enumerate(idx):
      if i < self.g.size:
        b = self.blocks[i]
        lo, k = int(self.rows.offset[b]), int(self.rows.n[b])
        x[j * span:j * span + k], y[j * span:j * span + k], counts[j] = host.x[lo:lo + k], host.y[lo:lo + k], k
    store = jax.device_put(DeviceRows(x, y, self.rows.palette))
    return clients, store, jnp.asarray(np.arange(width) * span, jnp.int32), jnp.asarray(counts)

  prefetch = inputs

  def written(self, idx, states) -> None:
    """Copies a call's updated states back into the host stack (nothing for a warm-up call, `idx` None)."""
    if idx is None:
      return
    real = idx < self.g.size
    new = jax.device_get(states)
    for host, values in zip(jax.tree.leaves(self.stacked), jax.tree.leaves(new)):
      host[idx[real]] = values[real]


def compiled_peak(lowered) -> Optional[int]:
  """The peak device bytes XLA's memory analysis gives a lowered call once compiled (arguments, outputs and
  temporaries), or None where the backend gives none."""
  stats = lowered.compile().memory_analysis()
  if stats is None:
    return None
  peak = getattr(stats, 'peak_memory_in_bytes', 0)
  return int(peak or stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)


class Executor:
  """The interface: `run(...)` one round of a group's participants, `correct(...)` its clients' scores."""

  def __init__(self, eval_batch_size: int):
    self.eval_batch_size = eval_batch_size
    self._compiled: dict = {}
    self._lock = threading.Lock()
    self._making: dict = {}  # key -> the lock its maker holds (groups may run in threads, `group_threads`)

  def compiled(self, name: str, *where: Any, make: Callable[[], Any]) -> Any:
    """The function cached under (name, *where), made on first use (once, whichever thread asks first)."""
    key = (name,) + where
    if key not in self._compiled:
      with self._lock:
        making = self._making.setdefault(key, threading.RLock())
      with making:
        if key not in self._compiled:
          self._compiled[key] = make()
    return self._compiled[key]

  def compiled_functions(self) -> list[tuple]:
    """The (name, group, phase) keys of the functions compiled so far (benchmarks read compile counts here)."""
    return list(self._compiled)

  def run(self, g: Group, program: ClientProgram, phase: int, stacked, slot_idx: np.ndarray, broadcast,
          key: jax.Array) -> tuple[Any, Any, jnp.ndarray]:
    """One round of the group's participant slots (slot_idx: local client indices; g.stacked_size marks an empty
    slot): (updated stacked states, uploads stacked over slots (zeros in empty slots), per-slot mean loss)."""
    raise NotImplementedError

  def correct(self, g: Group, evaluation: Evaluation, phase: int, stacked, broadcast, test: EvalSet, which: str
              ) -> np.ndarray:
    """Correct predictions [group size, len(evaluation.names)] of every client of the group on its test rows."""
    raise NotImplementedError

  def statistics(self, g: Group, evaluation: Evaluation, phase: int, stacked, broadcast, key: jax.Array) -> Any:
    """The evaluation's statistics (`Evaluation.statistics`) summed over the training rows of every client of the
    group, in batches of the run's batch size of each client's rows shuffled and augmented as its training batches
    (a train loader's, as HeteroFL's statistics pass), client k's from `plan.statistics_key(key, k)`."""
    raise NotImplementedError


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
    its peak, resident arrays included, grows linearly with the width. Without a budget (or where the backend
    reports no analysis) DEFAULT_MAX_WIDTH; with `chunk_size` set, that."""
    if self.chunk_size or self.memory_budget is None:
      return self.max_width()
    ladder = width_ladder(self.DEFAULT_MAX_WIDTH, self.num_devices)
    if len(ladder) < 2:
      return ladder[0]
    narrow, next_up = ladder[-1], ladder[-2]
    peaks = [compiled_peak(lower(w)) for w in (narrow, next_up)]
    if None in peaks:
      return self.max_width()
    per_client = max((peaks[1] - peaks[0]) / (next_up - narrow), 1.0)
    fits = narrow + int((self.memory_budget - peaks[0]) // per_client)
    self.analysis[g.spec.index] = {'widths': (narrow, next_up), 'peaks': tuple(peaks), 'per_client': per_client}
    if fits < narrow:
      gib = lambda b: f'{b / 2**30:.4g} GiB ({b} bytes)'  # the command line names the budget in GiB
      raise ConfigError(
          f'ExecutionConfig.memory_budget={gib(self.memory_budget)}: a round of group {g.arch!r} needs '
          f'{gib(peaks[0])} on the device with {narrow} client(s) per call (its clients\' states and rows '
          f'included). Fix: a larger ExecutionConfig.memory_budget, or fewer clients or a smaller model in that '
          f'group.')
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
        fns[width] = jax.jit(make(width), donate_argnums=(0, 1) if name == 'vmap_update' else 0)
        warm(fns[width], width)
      return fns
    return self.compiled(name, g.spec.index, phase, slots, make=build)

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
      return (*source.inputs(idx, width), jnp.asarray(idx), jnp.full(width, slots), g.stacked_ids, broadcast, key,
              jnp.zeros(steps.shape[1], jnp.int32), jnp.int32(0))

    def one_slot():
      first, store, offsets, counts, idx, _, *rest = empty(1)
      return first, store, offsets, counts, idx, *rest

    shapes = self.compiled('vmap_buffers', g.spec.index, phase, slots, make=lambda: jax.eval_shape(
        self._make_update(g, program, 1), *one_slot())[1:])  # a slot's results
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros((slots,) + s.shape[1:], s.dtype), shapes)

    def warm(fn, width):
      first, store, *rest = empty(width)
      source.written(None, fn(first, zeros(), store, *rest)[0])

    if (g.spec.index, phase) not in self.widest:  # the phase's first round: the widest chunk its memory allows
      update = lambda width: jax.jit(self._with_buffers(self._make_update(g, program, width)), donate_argnums=(0, 1))
      self.widest[(g.spec.index, phase)] = self.budget_width(g, lambda width: update(width).lower(
          empty(width)[0], zeros(), *empty(width)[1:]))
    fns = self._functions('vmap_update', g, phase, slots,
                          lambda width: self._with_buffers(self._make_update(g, program, width)), warm)
    out = zeros()
    chunks = self.plan('train', g, steps.sum(1), phase)
    calls = [(chunk, self._slots(local[chunk.positions], chunk.width, g.stacked_size)) for chunk in chunks]
    ahead = source.prefetch(calls[0][1], calls[0][0].width) if calls else None
    for c, (chunk, idx) in enumerate(calls):
      first, store, offsets, counts = ahead
      first = source.states() if first is None else first
      dest = self._slots(chunk.positions, chunk.width, slots)
      trips = jnp.asarray(steps[chunk.positions].max(0, initial=0), jnp.int32)
      passes = -(-int(statistics_rows[chunk.positions].max(initial=0)) // self.pass_rows(chunk.width))
      new, out = fns[chunk.width](first, out, store, offsets, counts, jnp.asarray(idx), jnp.asarray(dest),
                                  g.stacked_ids, broadcast, key, trips, jnp.int32(passes))
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

  def _make_update(self, g: Group, program: ClientProgram, width: int):
    """A chunk's update: (stacked states, or with `stream` the chunk's own, store, offsets, counts, slot_idx,
    client_ids, broadcast, key, trips, passes) -> (the same states updated, uploads, losses)."""
    num_rows, unroll, chunk, stream = g.rows.n_max, self.scan_unroll, self.pass_rows(width), self.stream

    def update(states, store, offsets, counts, slot_idx, client_ids, broadcast, key, trips, passes):
      clients = states if stream else take(states, slot_idx)
      ids = jnp.take(client_ids, slot_idx, mode='clip')
      rngs = jax.vmap(lambda c: jax.random.fold_in(key, c))(ids)
      one = lambda c, off, cnt, k, b: run_client_rows(program, g.model, c, RowsOf(store, off, cnt, num_rows), b, k,
                                                      trips, passes, chunk, unroll)
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
      return (store, offsets, row_counts, jnp.asarray(idx), jnp.asarray(self._slots(positions, width, g.size)),
              broadcast, states)

    scores = jnp.zeros((g.size, len(evaluation.names)), jnp.int32)

    def warm(fn, width):
      fn(jnp.zeros_like(scores), *args(np.zeros(0, np.int32), width), jnp.int32(0))
    fns = self._functions(f'vmap_eval_{which}', g, phase, g.size, lambda width: self._scores_into(
        self._make_eval(evaluation, test.rows.n_max, width)), warm)
    for chunk in self.plan(f'eval_{which}', g, -(-counts // self.eval_batch_size)):
      passes = -(-int(counts[chunk.positions].max(initial=0)) // self.pass_rows(chunk.width))
      scores = fns[chunk.width](scores, *args(chunk.positions, chunk.width), jnp.int32(passes))
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
      return (store, offsets, counts, jnp.asarray(idx), g.stacked_ids, broadcast, key, states)

    shapes = jax.eval_shape(lambda *a: core(a[-1], *a[:-1], jnp.int32(0)), *args(np.zeros(0, np.int32), 1))
    total = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def warm(fn, width):
      fn(jax.tree.map(jnp.zeros_like, total), *args(np.zeros(0, np.int32), width), jnp.int32(0))
    fns = self._functions('vmap_statistics', g, phase, g.size, lambda width: self._sum_into(core), warm)
    for chunk in self.plan('statistics', g, -(-g.train_sizes // batch)):
      total = fns[chunk.width](total, *args(chunk.positions, chunk.width), jnp.int32(chunk.work))
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


class SequentialExecutor(Executor):
  """The participants one by one from the host (`threads` at a time), each running only the valid slots of its
  plan."""

  def __init__(self, eval_batch_size: int, threads: int = 1):
    super().__init__(eval_batch_size)
    self.threads, self._pool = threads, None

  def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
    with self._lock:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix='client')
    return self._pool

  def functions(self, g: Group, program: ClientProgram, phase: int) -> dict:
    """The jitted pieces a participant of group g runs in `phase`: 'init', per stage a 'schedule' and a 'step'
    ('stages'), 'represent_into' and 'final' (benchmarks time them one by one). Programs of equal
    `ClientProgram.identity` share them across groups."""
    owner = ('program', program.identity) if program.identity is not None else ('group', g.spec.index, phase)
    return self.compiled('sequential', owner, make=lambda: self._make_fns(g, program))

  def stack_functions(self) -> dict:
    """The jitted 'take' (client i of a stack) and 'put' (client i written back, the stack donated)."""
    return self.compiled('stack', make=lambda: {
        'take': jax.jit(lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)),
        'put': jax.jit(lambda stacked, i, c: jax.tree.map(lambda a, v: a.at[i].set(v), stacked, c),
                       donate_argnums=0)})

  def run(self, g, program, phase, stacked, slot_idx, broadcast, key):
    stack = self.stack_functions()
    self.functions(g, program, phase)  # made once here, not by two client threads at once
    real = [int(i) for i in slot_idx if i < g.size]
    run = lambda i, client: self.run_one(g, program, phase, i, client, for_client(broadcast, i), key)
    done = {}
    if self.threads == 1 or len(real) == 1:
      for i in real:
        client, *done[i] = run(i, stack['take'](stacked, i))
        stacked = stack['put'](stacked, i, client)
    else:
      # `threads` clients run at once, one host thread each (XLA:CPU then uses every core); a thread takes the next
      # client as soon as its own is done, the clients with the most rows first, so that uneven clients leave no
      # thread waiting. Each client's round is independent of the others: the numbers do not depend on the
      # thread count or the order.
      order = iter(sorted(real, key=lambda i: -int(g.train_sizes[i])))
      pending = {}

      def submit():
        i = next(order, None)
        if i is not None:
          pending[self._threads().submit(run, i, stack['take'](stacked, i))] = i
      for _ in range(self.threads):
        submit()
      while pending:
        finished, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        for future in finished:
          i = pending.pop(future)
          client, *done[i] = future.result()
          stacked = stack['put'](stacked, i, client)
          submit()
    uploads, losses = [done[i][0] for i in real], [done[i][1] for i in real]
    # Uploads are laid out in the same fixed slots as the vmap executor, empty slots zero.
    zeros = self.empty_upload(g, program, phase, stacked, for_client(broadcast, 0))
    padded = uploads + [zeros] * (len(slot_idx) - len(uploads))
    losses = losses + [0.0] * (len(slot_idx) - len(losses))
    return stacked, jax.tree.map(lambda *a: jnp.stack(a), *padded), jnp.asarray(losses, jnp.float32)

  def empty_upload(self, g: Group, program: ClientProgram, phase: int, stacked, broadcast) -> Any:
    """The upload of an empty slot of group g in `phase`: zeros of the program's upload structure (`broadcast` as
    one client reads it, `for_client`)."""
    return self.compiled('empty_upload', g.spec.index, phase, make=lambda: self._empty_upload(
        g, program, self.functions(g, program, phase), stacked, broadcast))

  def _empty_upload(self, g: Group, program: ClientProgram, fns: dict, stacked, broadcast) -> Any:
    client = without_model(program, jax.eval_shape(self.stack_functions()['take'], stacked, 0))
    carry = jax.eval_shape(fns['init'], client, broadcast, jax.random.PRNGKey(0))
    reps = None
    if program.trained is not None:
      reps = jax.ShapeDtypeStruct((g.train.x.shape[1], g.model.feature_dim), jnp.float32)
      if program.representation_weights is not None:
        reps = jax.eval_shape(fns['weighted'], carry, g.train, 0, reps, broadcast, jax.random.PRNGKey(0))
    template = jax.eval_shape(fns['final'], carry, g.train, 0, reps, broadcast, jax.random.PRNGKey(0))[1]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)

  def run_one(self, g: Group, program: ClientProgram, phase: int, i: int, client, broadcast, key: jax.Array
              ) -> tuple[Any, Any, float]:
    """Client i of group g (its state `client`, unstacked, and `broadcast` as it reads it: `for_client`) in a round of
    `phase` from the host: prepare (where the program has it), init, the valid slots of each stage's plan,
    representations, final. Returns (client, upload, mean loss of its steps); the round's `key` is folded with the
    client's id, as every executor does."""
    fns = self.functions(g, program, phase)
    n = int(g.train_sizes[i])
    keys = client_keys(jax.random.fold_in(key, int(g.clients[i])))
    original, client = client, without_model(program, client)
    if program.prepare is not None:
      client = fns['prepare'](client, g.train, i, broadcast, keys['prepare'])
    carry = fns['init'](client, broadcast, keys['init'])
    total, steps = 0.0, 0
    for plan, stage_fns in zip(plan_stages(program, g.train.x.shape[1]), fns['stages']):
      train_key = stage_key(keys['train'], plan.index)
      schedule = None if plan.stage.generated else stage_fns['schedule'](train_key, n)
      for t in np.flatnonzero(plan.valid(n)).tolist():
        carry, loss = stage_fns['step'](carry, t, schedule, g.train.x, g.train.y, i, n, broadcast, train_key)
        total, steps = total + loss, steps + 1
    reps = None
    if program.trained is not None:
      trained = program.trained(carry)
      reps = self._represent(g, fns, trained.params, trained.model_state, i,
                             int(program.training.statistics_rows(n)))
      if program.representation_weights is not None:
        reps = fns['weighted'](carry, g.train, i, reps, broadcast, keys['final'])
    client, upload = fns['final'](carry, g.train, i, reps, broadcast, keys['final'])
    return with_model(program, client, original), upload, total / max(steps, 1)

  def _represent(self, g: Group, fns: dict, params, model_state, i: int, rows: int) -> jnp.ndarray:
    """Eval-mode representations [n_max, d] of client i's first `rows` training rows (zeros after), chunk by
    chunk (`represent_into`)."""
    n_max = g.train.x.shape[1]
    chunk = even_chunk(n_max, self.eval_batch_size)
    buf = jnp.zeros((n_max, g.model.feature_dim))
    for start in range(0, max(rows, 1), chunk):
      buf = fns['represent_into'](buf, params, model_state, g.train.x, i, start)
    return buf

  def _make_fns(self, g: Group, program: ClientProgram) -> dict:
    model = representation_model(g.spec)
    chunk = even_chunk(g.train.x.shape[1], self.eval_batch_size)

    def stage_fns(plan):
      step = lambda carry, t, schedule, x_all, y_all, i, n, broadcast, key: take_step(
          plan, carry, t, schedule, x_all, y_all, n, broadcast, key, client=i)
      return {'step': jax.jit(step), 'schedule': jax.jit(plan.schedule)}

    def final(carry, train, i, reps, broadcast, key):
      return program.final(carry, client_rows(program, train.x[i], train.y[i], train.n[i], reps), broadcast, key)

    def weighted_reps(carry, train, i, reps, broadcast, key):
      rows = client_rows(program, train.x[i], train.y[i], train.n[i])
      return weighted(reps, program.representation_weights(carry, rows, broadcast, key))

    def prepare(client, train, i, broadcast, key):
      return program.prepare(client, client_rows(program, train.x[i], train.y[i], train.n[i]), broadcast, key)

    represent = lambda buf, params, model_state, x_all, i, start: represent_into(
        model, buf, params, model_state, x_all[i], start, chunk)
    stages = [stage_fns(plan) for plan in plan_stages(program, g.train.x.shape[1])]
    return {
        'init': jax.jit(program.init),
        'stages': stages,
        'represent_into': jax.jit(represent, donate_argnums=0),
        'final': jax.jit(final),
        'prepare': jax.jit(prepare) if program.prepare is not None else None,
        'weighted': jax.jit(weighted_reps) if program.representation_weights is not None else None,
    }

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    take_one = self.stack_functions()['take']
    out = [self.correct_one(g, evaluation, phase, take_one(stacked, i), for_client(broadcast, i), test, which, i)
           for i in range(g.size)]
    return np.stack(out) if out else np.zeros((0, len(evaluation.names)))

  def statistics(self, g, evaluation, phase, stacked, broadcast, key):
    take_one = self.stack_functions()['take']
    chunk, training = min(g.spec.training.batch_size, g.train.x.shape[1]), g.spec.training

    def into(sums, evaluated, x_all, i, order, p, n, client_key):
      row, valid = statistics_batch(order, p, chunk, n)
      return statistics_of_batch(evaluation, training, sums, evaluated, x_all[i, row], valid, client_key, p)
    fns = self.compiled('sequential_statistics', g.spec.index, phase, make=lambda: {
        'prepare': jax.jit(functools.partial(prepare_evaluation, evaluation)), 'into': jax.jit(into),
        'order': jax.jit(statistics_order, static_argnums=2)})
    total = None
    for i in range(g.size):
      evaluated = fns['prepare'](take_one(stacked, i), for_client(broadcast, i))
      if total is None:
        total = zero_statistics(evaluation, evaluated, g.train.x[0], chunk)
      client_key = statistics_key(key, int(g.clients[i]))
      order = fns['order'](client_key, g.train.n[i], g.train.x.shape[1])
      for p in range(-(-max(int(g.train_sizes[i]), 1) // chunk)):
        total = fns['into'](total, evaluated, g.train.x, i, order, jnp.int32(p), g.train.n[i], client_key)
    return total

  def correct_one(self, g: Group, evaluation: Evaluation, phase: int, client, broadcast, test: EvalSet, which: str,
                  i: int) -> np.ndarray:
    """Correct predictions [len(evaluation.names)] of client i of group g (its state `client`, unstacked, and
    `broadcast` as it reads it: `for_client`) on its test rows."""
    chunk = even_chunk(test.arrays.x.shape[1], self.eval_batch_size)
    count = lambda counts, evaluated, x_all, y_all, j, start, n: count_into(
        evaluation, counts, evaluated, x_all[j], y_all[j], start, chunk, n)
    fns = self.compiled(f'sequential_eval_{which}', g.spec.index, phase, make=lambda: {
        'prepare': jax.jit(functools.partial(prepare_evaluation, evaluation)), 'count_into': jax.jit(count)})
    evaluated = fns['prepare'](client, broadcast)
    j = test.index(i)
    counts = jnp.zeros(len(evaluation.names), jnp.int32)
    for start in range(0, max(int(test.sizes[j]), 1), chunk):
      counts = fns['count_into'](counts, evaluated, test.arrays.x, test.arrays.y, j, start, test.arrays.n[j])
    return np.asarray(counts)
