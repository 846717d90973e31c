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
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import PER_CLIENT, ClientProgram, Evaluation, for_client, with_model, without_model
from fedjax_het.engine.client import client_statistics, run_client, score_client
from fedjax_het.engine.groups import EvalSet, Group, representation_model
from fedjax_het.engine.sharding import to_host
from fedjax_het.engine.plan import (client_keys, client_rows, count_into, even_chunk, plan_stages, represent_into,
                                    stage_key, statistics_into, take_step, zero_statistics)

STRATEGIES = ('vmap', 'sequential')


def take(tree: Any, idx) -> Any:
  """Rows `idx` of every leaf's leading axis (indices past the end clip to the last row)."""
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), tree)


def vmap_broadcast(fn: Callable, broadcast: Any, idx) -> Callable:
  """`fn(*args, broadcast)` vmapped over the leading axis of args, each call reading `for_client(broadcast, i)` for
  its slot's client i (idx [S]): the broadcast's PER_CLIENT part is gathered at idx and vmapped with the slots."""
  if not isinstance(broadcast, dict) or PER_CLIENT not in broadcast:
    return lambda *args: jax.vmap(lambda *a: fn(*a, broadcast))(*args)
  shared = {k: v for k, v in broadcast.items() if k != PER_CLIENT}
  per = take(broadcast[PER_CLIENT], idx)
  return lambda *args: jax.vmap(lambda p, *a: fn(*a, {**shared, PER_CLIENT: p}))(per, *args)


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

  def statistics(self, g: Group, evaluation: Evaluation, phase: int, stacked, broadcast) -> Any:
    """The evaluation's statistics (`Evaluation.statistics`) summed over the training rows of every client of the
    group, in batches of the run's batch size (a train loader's, as HeteroFL's statistics pass)."""
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
    one = lambda c, d, k, b: run_client(program, g.model, c, d, b, k, self.eval_batch_size, self.scan_unroll)

    def update(stacked, train, slot_idx, client_ids, broadcast, key):
      if full:  # the slots are the stacked group in order
        clients, data, ids = stacked, train, client_ids
      else:
        clients, data = take(stacked, slot_idx), take(train, slot_idx)
        ids = jnp.take(client_ids, slot_idx, mode='clip')
      rngs = jax.vmap(lambda c: jax.random.fold_in(key, c))(ids)
      new, uploads, losses = vmap_broadcast(one, broadcast, slot_idx)(clients, data, rngs)
      real = slot_idx < g.size
      uploads = jax.tree.map(lambda u: jnp.where(real.reshape((-1,) + (1,) * (u.ndim - 1)), u, jnp.zeros((), u.dtype)),
                             uploads)  # empty slots zero, in the upload's own dtype (a bool stays bool)
      if full:
        return new, uploads, losses
      stacked = jax.tree.map(lambda a, b: a.at[slot_idx].set(b, mode='drop'), stacked, new)
      return stacked, uploads, losses
    return update

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    fn = self.compiled(f'vmap_eval_{which}', g.spec.index, phase, make=lambda: jax.jit(
        self._make_eval(evaluation, test.shared)))
    return to_host(fn(stacked, test.arrays, broadcast))[:g.size]

  def statistics(self, g, evaluation, phase, stacked, broadcast):
    def gather(stacked, train, broadcast):
      size = jax.tree.leaves(stacked)[0].shape[0]
      per = vmap_broadcast(lambda c, t, b: client_statistics(evaluation, c, b, t, g.spec.training.batch_size),
                           broadcast, jnp.arange(size))(stacked, train)
      return jax.tree.map(lambda a: a[:g.size].sum(0), per)  # the clients past the group's size are padding
    return self.compiled('vmap_statistics', g.spec.index, phase, make=lambda: jax.jit(gather))(
        stacked, g.train, broadcast)

  def _make_eval(self, evaluation: Evaluation, shared: bool):
    def evaluate(stacked, test, broadcast):
      fn = lambda c, t, b: score_client(evaluation, c, b, t, self.eval_batch_size)
      size = jax.tree.leaves(stacked)[0].shape[0]
      if shared:
        one_test = jax.tree.map(lambda a: a[0], test)
        return vmap_broadcast(lambda c, b: fn(c, one_test, b), broadcast, jnp.arange(size))(stacked)
      return vmap_broadcast(fn, broadcast, jnp.arange(size))(stacked, test)
    return evaluate


class SequentialExecutor(Executor):
  """The participants one by one from the host (`threads` at a time), each running only the valid slots of its
  plan."""

  def __init__(self, eval_batch_size: int, threads: int = 1):
    super().__init__(eval_batch_size)
    self.threads, self._pool = threads, None

  def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
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
    }

  def correct(self, g, evaluation, phase, stacked, broadcast, test, which):
    take_one = self.stack_functions()['take']
    out = [self.correct_one(g, evaluation, phase, take_one(stacked, i), for_client(broadcast, i), test, which, i)
           for i in range(g.size)]
    return np.stack(out) if out else np.zeros((0, len(evaluation.names)))

  def statistics(self, g, evaluation, phase, stacked, broadcast):
    take_one = self.stack_functions()['take']
    chunk = min(g.spec.training.batch_size, g.train.x.shape[1])
    into = lambda sums, evaluated, x_all, i, start, n: statistics_into(evaluation, sums, evaluated, x_all[i], start,
                                                                       chunk, n)
    fns = self.compiled('sequential_statistics', g.spec.index, phase, make=lambda: {
        'prepare': jax.jit(evaluation.prepare), 'into': jax.jit(into)})
    total = None
    for i in range(g.size):
      evaluated = fns['prepare'](take_one(stacked, i), for_client(broadcast, i))
      if total is None:
        total = zero_statistics(evaluation, evaluated, g.train.x[0], chunk)
      for start in range(0, max(int(g.train_sizes[i]), 1), chunk):
        total = fns['into'](total, evaluated, g.train.x, i, start, g.train.n[i])
    return total

  def correct_one(self, g: Group, evaluation: Evaluation, phase: int, client, broadcast, test: EvalSet, which: str,
                  i: int) -> np.ndarray:
    """Correct predictions [len(evaluation.names)] of client i of group g (its state `client`, unstacked, and
    `broadcast` as it reads it: `for_client`) on its test rows."""
    chunk = even_chunk(test.arrays.x.shape[1], self.eval_batch_size)
    count = lambda counts, evaluated, x_all, y_all, j, start, n: count_into(
        evaluation, counts, evaluated, x_all[j], y_all[j], start, chunk, n)
    fns = self.compiled(f'sequential_eval_{which}', g.spec.index, phase, make=lambda: {
        'prepare': jax.jit(evaluation.prepare), 'count_into': jax.jit(count)})
    evaluated = fns['prepare'](client, broadcast)
    j = test.index(i)
    counts = jnp.zeros(len(evaluation.names), jnp.int32)
    for start in range(0, max(int(test.sizes[j]), 1), chunk):
      counts = fns['count_into'](counts, evaluated, test.arrays.x, test.arrays.y, j, start, test.arrays.n[j])
    return np.asarray(counts)
