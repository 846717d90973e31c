"""The sequential executor: the participants one by one from the host, each running the jitted pieces of its
program over only its real step slots (the interface: `engine.executor`)."""

from __future__ import annotations

import concurrent.futures
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import ClientProgram, Evaluation, for_client, prepare_evaluation, with_model, without_model
from fedjax_het.engine.client import weighted
from fedjax_het.engine.donation import ConsumingJit
from fedjax_het.engine.executor import Executor
from fedjax_het.engine.groups import (EvalSet, Group, put_client, representation_model, stack_slots, take_client,
                                      take_client_jit)
from fedjax_het.engine.plan import (client_rows, count_into, even_chunk, plan_stages, represent_into,
                                    round_client_keys, stage_key, statistics_batch, statistics_key,
                                    statistics_of_batch, statistics_order, take_step, zero_statistics)
from fedjax_het.engine.sharding import device_zeros


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
    """The jitted 'take' (client i of a stack), 'put' (client i written back, the stack donated) and 'copy'; for a
    stack of one client 'unstack' and 'restack', which consume their argument and so copy nothing (XLA writes the
    output over the donated input of the same size)."""
    return self.compiled('stack', make=lambda: {
        'take': take_client_jit,
        'copy': jax.jit(lambda tree: jax.tree.map(jnp.copy, tree)),
        'put': jax.jit(put_client, donate_argnums=0),
        'unstack': jax.jit(lambda stacked: take_client(stacked, 0), donate_argnums=0),
        'restack': jax.jit(lambda client: jax.tree.map(lambda a: a[None], client), donate_argnums=0)})

  def run(self, g, program, phase, stacked, slot_idx, broadcast, key):
    stack = self.stack_functions()
    self.functions(g, program, phase)  # made once here, not by two client threads at once
    real = [int(i) for i in slot_idx if i < g.size]
    run = lambda i, client: self.run_one(g, program, phase, i, client, for_client(broadcast, i), key, owned=True)
    done = {}
    if g.stacked_size == 1 and real:  # the stack is the client: the round consumes it, as vmap's does
      client, *done[0] = run(0, stack['unstack'](stacked))
      stacked = stack['restack'](client)
    elif self.threads == 1 or len(real) == 1:
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
    return (stacked, *stack_slots(padded, [np.float32(l) if isinstance(l, float) else l for l in losses]))

  def empty_upload(self, g: Group, program: ClientProgram, phase: int, stacked, broadcast) -> Any:
    """The upload of an empty slot of group g in `phase`: zeros of the program's upload structure (`broadcast` as
    one client reads it, `for_client`)."""
    return self.compiled('empty_upload', g.spec.index, phase, make=lambda: self._empty_upload(
        g, program, self.functions(g, program, phase), stacked, broadcast))

  def _empty_upload(self, g: Group, program: ClientProgram, fns: dict, stacked, broadcast) -> Any:
    client = without_model(program, jax.eval_shape(self.stack_functions()['take'], stacked, 0))
    key = jax.eval_shape(jax.random.PRNGKey, 0)  # its shape only: an eager key compiles programs
    carry = jax.eval_shape(fns['init'], client, broadcast, key)
    reps = None
    if program.trained is not None:
      reps = jax.ShapeDtypeStruct((g.train.x.shape[1], g.model.feature_dim), jnp.float32)
      if program.representation_weights is not None:
        reps = jax.eval_shape(fns['weighted'], carry, g.train, 0, reps, broadcast, key)
    template = jax.eval_shape(fns['final'], carry, g.train, 0, reps, broadcast, key)[1]
    return jax.tree.map(lambda s: device_zeros(s.shape, s.dtype), template)

  def run_one(self, g: Group, program: ClientProgram, phase: int, i: int, client, broadcast, key: jax.Array,
              owned: bool = False) -> tuple[Any, Any, float]:
    """Client i of group g (its state `client`, unstacked, and `broadcast` as it reads it: `for_client`) in a round of
    `phase` from the host: prepare (where the program has it), init, the valid slots of each stage's plan,
    representations, final. Returns (client, upload, mean loss of its steps); the round's `key` is folded with the
    client's id, as every executor does. `owned`: the caller holds no other reference to `client`'s arrays, which
    the round then consumes (init and final write over them); otherwise it works on a copy."""
    fns = self.functions(g, program, phase)
    if not owned:
      client = self.stack_functions()['copy'](client)
    n = int(g.train_sizes[i])
    keys = round_client_keys(key, np.int32(g.clients[i]))
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
    buf = device_zeros((n_max, g.model.feature_dim))
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
    # init and final return most of the client they receive: consuming it spares each a copy of the model
    return {
        'init': ConsumingJit(program.init),
        'stages': stages,
        'represent_into': jax.jit(represent, donate_argnums=0),
        'final': ConsumingJit(final),
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
        total = fns['into'](total, evaluated, g.train.x, i, order, np.int32(p), g.train.n[i], client_key)
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
    counts = device_zeros(len(evaluation.names), np.int32)
    for start in range(0, max(int(test.sizes[j]), 1), chunk):
      counts = fns['count_into'](counts, evaluated, test.arrays.x, test.arrays.y, j, start, test.arrays.n[j])
    return np.asarray(counts)
