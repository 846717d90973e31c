"""Executors: how a group's participants run their `ClientProgram` and how its clients are scored. Both run
exactly the program's and the evaluation's functions, so they give the same numbers.

  VmapExecutor:       `jax.vmap(run_client)` over the group's participant slots in one jitted call, the local
                      steps in a lax.scan (optionally in chunks of `chunk_size` clients). The fast path on
                      accelerators; with a client mesh, each device updates its share of the slots (SPMD).
  SequentialExecutor: the host walks the participants; each runs init, its real local steps and final, each
                      jitted once per group and phase and reused. `threads` clients run at once, one host thread
                      each. The fast path on XLA:CPU, which runs convolutions inside while-loops and vmapped
                      (grouped) convolutions several times slower.
Executors cache their compiled functions per (name, group, phase); `compiled_functions()` lists them.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import (Batch, ClientProgram, ClientRows, Evaluation, program_stages, stage_key,
                             stage_steps_per_epoch, with_model, without_model)
from fedjax_het.engine.client import client_keys, count_correct, run_client, score_client
from fedjax_het.engine.groups import EvalSet, Group
from fedjax_het.local_training import batch_row_mask, batch_schedule, step_key
from fedjax_het.models.forward import forward

STRATEGIES = ('vmap', 'sequential')


def default_strategy(backend: Optional[str] = None) -> str:
  """'sequential' on CPU (measured faster there, see README), 'vmap' on GPU/TPU."""
  return 'sequential' if (backend or jax.default_backend()) == 'cpu' else 'vmap'


def default_conv(strategy: str, backend: Optional[str] = None) -> str:
  """On CPU: 'im2col' under vmap (grouped convolutions are slow there), 'auto' otherwise; 'xla' on GPU/TPU.
  Figures in the README."""
  if (backend or jax.default_backend()) != 'cpu':
    return 'xla'
  return 'im2col' if strategy == 'vmap' else 'auto'


def default_eval_batch_size(backend: Optional[str] = None) -> int:
  """Rows per eval-mode forward pass (representations, evaluation): 64 on CPU, where larger passes spill the
  im2col patches out of cache and run ~2x slower per row (benchmarks/cpu_kernels.py --parts=represent), 256 on
  GPU/TPU."""
  return 64 if (backend or jax.default_backend()) == 'cpu' else 256


def default_client_threads() -> int:
  """Host threads of the sequential strategy: 2 (measured on 2 cores, README), at most the core count."""
  return max(1, min(2, os.cpu_count() or 1))


def even_chunk(rows: int, max_chunk: int) -> int:
  """The smallest chunk that covers `rows` in as few passes of at most `max_chunk` rows (288 rows with at most
  256 per pass: 2 x 144, not 256 + a clamped 256 that recomputes 224 rows)."""
  passes = -(-max(rows, 1) // max(max_chunk, 1))
  return -(-max(rows, 1) // passes)


def take(tree: Any, idx) -> Any:
  """Rows `idx` of every leaf's leading axis (indices past the end clip to the last row)."""
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), tree)


class Executor:
  """The interface: `run(...)` one round of a group's participants, `correct(...)` its clients' scores."""

  def __init__(self, eval_batch_size: int):
    self.eval_batch_size = eval_batch_size
    self._compiled: dict = {}

  def compiled(self, name: str, *where: Any, make: Callable[[], Any]) -> Any:
    """The function cached under (name, *where), made on first use."""
    key = (name,) + where
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


class VmapExecutor(Executor):
  """`run_client` vmapped over a group's slots in one jitted call (or in chunks of `chunk_size` clients)."""

  def __init__(self, eval_batch_size: int, chunk_size: int = 0, scan_unroll: int = 1):
    super().__init__(eval_batch_size)
    self.chunk_size, self.scan_unroll = chunk_size, scan_unroll

  def run(self, g, program, phase, stacked, slot_idx, broadcast, key):
    full = not self.chunk_size and len(slot_idx) == g.stacked_size and np.array_equal(
        slot_idx[:g.size], np.arange(g.size))
    if full:  # Full participation: the slots are the (padded) group itself, so no gather/scatter copies.
      update = self.compiled('vmap_update_full', g.spec.index, phase, make=lambda: jax.jit(
          self._make_update(g, program, full=True), donate_argnums=0))
      return update(stacked, g.train, jnp.asarray(slot_idx), g.stacked_ids, broadcast, key)
    chunk = self.chunk_size or len(slot_idx)
    pad = (-len(slot_idx)) % chunk
    slot_idx = np.concatenate([slot_idx, np.full(pad, g.stacked_size, np.int32)])
    update = self.compiled('vmap_update', g.spec.index, phase, make=lambda: jax.jit(
        self._make_update(g, program, full=False), donate_argnums=0))
    uploads, losses = [], []
    for c in range(0, len(slot_idx), chunk):
      stacked, up, loss = update(stacked, g.train, jnp.asarray(slot_idx[c:c + chunk]), g.stacked_ids, broadcast,
                                 key)
      uploads.append(up)
      losses.append(loss)
    keep = len(slot_idx) - pad
    cat = lambda *a: jnp.concatenate(a)[:keep]
    return stacked, jax.tree.map(cat, *uploads), jnp.concatenate(losses)[:keep]

  def _make_update(self, g: Group, program: ClientProgram, full: bool):
    one = lambda c, d, b, k: run_client(program, g.model, c, d, b, k, self.eval_batch_size, self.scan_unroll)

    def update(stacked, train, slot_idx, client_ids, broadcast, key):
      if full:  # the slots are the stacked group in order
        clients, data, ids = stacked, train, client_ids
      else:
        clients, data = take(stacked, slot_idx), take(train, slot_idx)
        ids = jnp.take(client_ids, slot_idx, mode='clip')
      rngs = jax.vmap(lambda c: jax.random.fold_in(key, c))(ids)
      new, uploads, losses = jax.vmap(one, in_axes=(0, 0, None, 0))(clients, data, broadcast, rngs)
      real = slot_idx < g.size
      uploads = jax.tree.map(lambda u: jnp.where(real.reshape((-1,) + (1,) * (u.ndim - 1)), u, 0), uploads)
      if full:
        return new, uploads, losses
      stacked = jax.tree.map(lambda a, b: a.at[slot_idx].set(b, mode='drop'), stacked, new)
      return stacked, uploads, losses
    return update

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    fn = self.compiled(f'vmap_eval_{which}', g.spec.index, phase, make=lambda: jax.jit(
        self._make_eval(evaluation, test.shared)))
    return np.asarray(fn(stacked, test.arrays, broadcast))[:g.size]

  def _make_eval(self, evaluation: Evaluation, shared: bool):
    def evaluate(stacked, test, broadcast):
      fn = lambda c, t: score_client(evaluation, c, broadcast, t, self.eval_batch_size)
      if shared:
        return jax.vmap(fn, in_axes=(0, None))(stacked, jax.tree.map(lambda a: a[0], test))
      return jax.vmap(fn)(stacked, test)
    return evaluate


class SequentialExecutor(Executor):
  """The participants one by one from the host (`threads` at a time), each running only its real local steps."""

  def __init__(self, eval_batch_size: int, threads: int = 1):
    super().__init__(eval_batch_size)
    self.threads, self._pool = threads, None

  def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix='client')
    return self._pool

  def functions(self, g: Group, program: ClientProgram, phase: int) -> dict:
    """The jitted pieces a participant of group g runs in `phase`: 'init', per stage a 'schedule' and a 'step'
    ('stages'; the first stage's also as 'schedule' and 'step'), 'represent_into' and 'final' (benchmarks time
    them one by one). They read the group's model only to compute representations (`ClientProgram.trained`)."""
    # Groups that run the same program object on equally padded rows share these functions, and programs that do
    # not read the classifier (`ClientProgram.reads_model`, e.g. GeFL's generator training) their compiled code.
    owner = g.spec.index if program.trained is not None else None
    return self.compiled('sequential', program, owner, g.train.x.shape[1:], phase,
                         make=lambda: self._make_fns(g, program))

  def stack_functions(self) -> dict:
    """The jitted 'take' (client i of a stack) and 'put' (client i written back, the stack donated)."""
    return self.compiled('stack', make=lambda: {
        'take': jax.jit(lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)),
        'put': jax.jit(lambda stacked, i, c: jax.tree.map(lambda a, v: a.at[i].set(v), stacked, c),
                       donate_argnums=0)})

  def run(self, g, program, phase, stacked, slot_idx, broadcast, key):
    fns = self.functions(g, program, phase)
    stack = self.stack_functions()
    real = [int(i) for i in slot_idx if i < g.size]
    uploads, losses = [], []
    # Waves of `threads` clients run concurrently (one host thread each: XLA:CPU then uses every core); each
    # client's round is independent of the others, so the numbers do not depend on the thread count.
    for w in range(0, len(real), self.threads):
      wave = real[w:w + self.threads]
      taken = [stack['take'](stacked, i) for i in wave]
      run = lambda a: self._client(g, program, fns, a[0], a[1], broadcast, key)
      done = list(self._threads().map(run, zip(wave, taken))) if len(wave) > 1 else [run((wave[0], taken[0]))]
      for i, (client, upload, loss) in zip(wave, done):
        stacked = stack['put'](stacked, i, client)
        uploads.append(upload)
        losses.append(loss)
    # Uploads are laid out in the same fixed slots as the vmap executor, empty slots zero.
    if 'empty_upload' not in fns:
      client = without_model(program, jax.eval_shape(stack['take'], stacked, 0))
      carry = jax.eval_shape(fns['init'], client, broadcast, jax.random.PRNGKey(0))
      reps = None
      if program.trained is not None:
        reps = jax.ShapeDtypeStruct((g.train.x.shape[1], g.model.feature_dim), jnp.float32)
      template = jax.eval_shape(fns['final'], carry, g.train, 0, reps, broadcast, jax.random.PRNGKey(0))[1]
      fns['empty_upload'] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)
    zeros = fns['empty_upload']
    padded = uploads + [zeros] * (len(slot_idx) - len(uploads))
    losses = losses + [0.0] * (len(slot_idx) - len(losses))
    return stacked, jax.tree.map(lambda *a: jnp.stack(a), *padded), jnp.asarray(losses, jnp.float32)

  def _client(self, g: Group, program: ClientProgram, fns: dict, i: int, client, broadcast, key):
    """Client i's round from the host: init, the real local steps of each stage, representations, final."""
    training = program.training
    slots = training.slots(training.rows or g.train.x.shape[1])
    n = training.rows or g.train.n[i]
    keys = client_keys(jax.random.fold_in(key, int(g.clients[i])))
    original, client = client, without_model(program, client)
    carry = fns['init'](client, broadcast, keys['init'])
    total, steps = 0.0, 0
    for k, (stage, stage_fns) in enumerate(zip(program_stages(program), fns['stages'])):
      train_key = stage_key(keys['train'], k)
      idx = None
      if not stage.generated:
        idx, _ = stage_fns['schedule'](jax.random.fold_in(train_key, 0), n)
      per_epoch = int(stage_steps_per_epoch(training, stage, g.train_sizes[i]))
      taken = 0
      for e in range(stage.epochs):
        for s in range(per_epoch):
          if training.max_steps is not None and taken >= training.max_steps:
            break  # --local_steps: the stage's first max_steps steps only
          carry, loss = stage_fns['step'](carry, g.train.x, g.train.y, i, idx, e * slots + s, s, n, broadcast,
                                          step_key(train_key, e, s))
          total, steps, taken = total + loss, steps + 1, taken + 1
    reps = None
    if program.trained is not None:
      trained = program.trained(carry)
      rows = int(program.training.statistics_rows(g.train_sizes[i]))
      reps = self._represent(g, fns, trained.params, trained.model_state, i, rows)
    client, upload = fns['final'](carry, g.train, i, reps, broadcast, keys['final'])
    return with_model(program, client, original), upload, total / max(steps, 1)

  def _represent(self, g: Group, fns: dict, params, model_state, i: int, rows: int) -> jnp.ndarray:
    """Eval-mode representations [n_max, d] of client i's first `rows` training rows (zeros after), chunk by
    chunk."""
    n_max = g.train.x.shape[1]
    chunk = even_chunk(n_max, self.eval_batch_size)
    buf = jnp.zeros((n_max, g.model.feature_dim))
    for start in range(0, max(rows, 1), chunk):
      buf = fns['represent_into'](buf, params, model_state, g.train.x, i, start)
    return buf

  def _make_fns(self, g: Group, program: ClientProgram) -> dict:
    training, model = program.training, g.model
    n_max = g.train.x.shape[1]
    chunk = even_chunk(n_max, self.eval_batch_size)

    def stage_fns(stage):
      def step(carry, x_all, y_all, i, schedule, slot, slot_in_epoch, n, broadcast, key):
        if stage.generated:
          return stage.step(carry, Batch(None, None, None, jnp.arange(training.batch_size) < n), broadcast, key)
        rows = schedule[slot]
        mask = None if training.drop_last else batch_row_mask(slot_in_epoch, n, training.batch_size)
        if training.rows is not None:
          return stage.step(carry, Batch(None, None, rows, mask), broadcast, key)
        return stage.step(carry, Batch(x_all[i, rows], y_all[i, rows], rows, mask), broadcast, key)
      schedule = lambda rng, n: batch_schedule(rng, n, training.rows or n_max, training.batch_size, stage.epochs,
                                               training.order, training.drop_last)
      return {'step': jax.jit(step), 'schedule': jax.jit(schedule)}

    def final(carry, train, i, reps, broadcast, key):
      n = train.n[i]
      return program.final(carry, ClientRows(train.x[i], train.y[i], training.statistics_rows(n), n, reps),
                           broadcast, key)

    def represent_into(buf, params, model_state, x_all, i, start):
      # Near the end dynamic_slice and dynamic_update_slice clamp the start identically, so the last chunk
      # recomputes a few rows instead of reading past n_max.
      rows = jax.lax.dynamic_slice_in_dim(x_all[i], start, chunk)
      reps = forward(model, params, model_state, rows, False)[1]
      return jax.lax.dynamic_update_slice_in_dim(buf, reps, start, 0)

    stages = [stage_fns(stage) for stage in program_stages(program)]
    return {
        'init': jax.jit(program.init),
        'stages': stages,
        'schedule': stages[0]['schedule'],  # the first stage's, by the names benchmarks time them under
        'step': stages[0]['step'],
        'represent_into': jax.jit(represent_into, donate_argnums=0),
        'final': jax.jit(final),
    }

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    chunk = even_chunk(test.arrays.x.shape[1], self.eval_batch_size)

    def count_into(counts, evaluated, x_all, y_all, j, start, n):
      first = jnp.minimum(start, x_all.shape[1] - chunk)  # where dynamic_slice reads when clamped
      x = jax.lax.dynamic_slice_in_dim(x_all[j], first, chunk)
      y = jax.lax.dynamic_slice_in_dim(y_all[j], first, chunk)
      row = first + jnp.arange(chunk)
      return counts + count_correct(evaluation, evaluated, x, y, (row >= start) & (row < n))

    fns = self.compiled(f'sequential_eval_{which}', g.spec.index, phase, make=lambda: {
        'prepare': jax.jit(evaluation.prepare), 'count_into': jax.jit(count_into)})
    take_one = self.stack_functions()['take']
    out = []
    for i in range(g.size):
      evaluated = fns['prepare'](take_one(stacked, i), broadcast)
      j = test.index(i)
      counts = jnp.zeros(len(evaluation.names), jnp.int32)
      for start in range(0, max(int(test.sizes[j]), 1), chunk):
        counts = fns['count_into'](counts, evaluated, test.arrays.x, test.arrays.y, j, start, test.arrays.n[j])
      out.append(counts)
    return np.stack([np.asarray(c) for c in out]) if out else np.zeros((0, len(evaluation.names)))
