"""One client's round and one client's score as pure functions on device: what the vmap executor maps over a
chunk of clients (`run_client_rows`, `score_client_rows`, on rows in a flat store) or over padded arrays
(`run_client`, `score_client`). All run the plan of `engine.plan`, which the sequential executor runs from the host
instead."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_het.core import (ClientProgram, ClientRows, ClientState, Evaluation, prepare_evaluation, with_model,
                             without_model)
from fedjax_het.data.federated import ClientArrays
from fedjax_het.local_training import LocalTraining
from fedjax_het.engine.plan import (client_keys, client_rows, correct_counts, count_into, even_chunk, masked,
                                    pass_window, plan_stages, represent_into, slot_of_step, stage_key,
                                    statistics_batch, statistics_of_batch, statistics_order, step_on_rows, take_step,
                                    zero_statistics)
from fedjax_het.engine.stores import DeviceRows, client_view, gather_rows
from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.forward import forward


def represent_rows(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, chunk: int
                   ) -> jnp.ndarray:
  """Eval-mode representations [n_max, d] of all rows of one client's x [n_max, ...], in passes of at most
  `chunk` rows (`represent_into`). Pure and vmappable."""
  n_max = x.shape[0]
  chunk = even_chunk(n_max, chunk)
  buf = jnp.zeros((n_max, model.feature_dim))
  return jax.lax.fori_loop(0, -(-n_max // chunk), lambda c, b: represent_into(model, b, params, model_state, x,
                                                                               c * chunk, chunk), buf)


def run_client(program: ClientProgram, model: HeteroClassifier, client: ClientState, data: ClientArrays,
               broadcast: Any, rng: jax.Array, rep_chunk: int = 256, unroll: int | bool = 1
               ) -> tuple[ClientState, Any, jnp.ndarray]:
  """ONE client's round: prepare (where the program has it) -> init -> every step slot of each stage's plan in a
  lax.scan (the slots the client does not take masked) -> the eval-mode representations if the program reads them
  -> final. Returns (client, upload, mean loss of its steps).

  `data` holds this client's padded rows (x [n_max, ...], y [n_max], n []); `unroll` is lax.scan's."""
  keys = client_keys(rng)
  start = without_model(program, client)
  if program.prepare is not None:
    start = program.prepare(start, client_rows(program, data.x, data.y, data.n), broadcast, keys['prepare'])
  carry = program.init(start, broadcast, keys['init'])
  total, count = 0.0, 0
  for plan in plan_stages(program, data.x.shape[0]):
    if not plan.length:  # a stage of 0 epochs (GeFL's synthetic-only rounds have no real epochs)
      continue
    key = stage_key(keys['train'], plan.index)
    schedule, valid = plan.schedule(key, data.n), plan.valid(data.n)

    def body(carry, t, plan=plan, schedule=schedule, key=key):
      step = lambda c: take_step(plan, c, t, schedule, data.x, data.y, data.n, broadcast, key)
      return masked(step, carry, valid[t])

    carry, losses = jax.lax.scan(body, carry, jnp.arange(plan.length), unroll=unroll)
    total, count = total + losses.sum(), count + valid.sum()
  trained = program.trained(carry) if program.trained is not None else None
  reps = program_representations(program, carry, lambda weights: weighted(represent_rows(
      model, trained.params, trained.model_state, data.x, rep_chunk), weights),
      client_rows(program, data.x, data.y, data.n), broadcast, keys['final'])
  out, upload = program.final(carry, client_rows(program, data.x, data.y, data.n, reps), broadcast, keys['final'])
  return with_model(program, out, client), upload, total / jnp.maximum(count, 1)


def score_client(evaluation: Evaluation, client: ClientState, broadcast: Any, test: ClientArrays, chunk: int
                 ) -> jnp.ndarray:
  """Correct predictions [len(names)] of one client on its padded test rows, in passes of at most `chunk` rows
  (`count_into`). Pure."""
  evaluated = prepare_evaluation(evaluation, client, broadcast)
  n_max = test.x.shape[0]
  chunk = even_chunk(n_max, chunk)
  counts = jnp.zeros(len(evaluation.names), jnp.int32)
  return jax.lax.fori_loop(0, -(-n_max // chunk), lambda c, counts: count_into(
      evaluation, counts, evaluated, test.x, test.y, c * chunk, chunk, test.n), counts)


def client_statistics(evaluation: Evaluation, training: LocalTraining, client: ClientState, broadcast: Any,
                      train: ClientArrays, chunk: int, key: jax.Array) -> Any:
  """The evaluation's statistics (`Evaluation.statistics`) summed over one client's training rows, in batches of
  `chunk` rows of a shuffled order (the last one shorter) augmented as its training batches, from the client's
  `key` (`plan.statistics_key`), whatever the group's padding. Pure."""
  evaluated = prepare_evaluation(evaluation, client, broadcast)
  n_max = train.x.shape[0]
  chunk = min(chunk, n_max)
  order = statistics_order(key, train.n, n_max)

  def one(p, sums):
    row, valid = statistics_batch(order, p, chunk, train.n)
    return statistics_of_batch(evaluation, training, sums, evaluated, train.x[row], valid, key, p)
  return jax.lax.fori_loop(0, -(-n_max // chunk), one, zero_statistics(evaluation, evaluated, train.x, chunk))


def weighted(reps: jnp.ndarray, weights: Optional[jnp.ndarray]) -> jnp.ndarray:
  """reps [rows, d] as they are, or their weighted sums W^T reps [K, d] (`ClientProgram.representation_weights`)."""
  return reps if weights is None else weights.T @ reps


class RowsOf(NamedTuple):
  """Where one client's rows are in a flat store (`stores.DeviceRows`): from `offset`, `n` of them; `num_rows`
  (static) is the group's largest client, the length of the padded view its `prepare` and `final` read."""
  store: DeviceRows
  offset: jnp.ndarray
  n: jnp.ndarray
  num_rows: int

  def pick(self, index) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(x, y) of the client's rows `index` (zeros past n)."""
    return gather_rows(self.store, self.offset, self.n, index)

  def view(self) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The client's rows as padded arrays x [num_rows, ...], y [num_rows]."""
    return client_view(self.store, self.offset, self.n, self.num_rows)


def represent_flat(model: HeteroClassifier, params: Any, model_state: Any, rows: RowsOf, count, passes,
                   chunk: int, weights: Optional[jnp.ndarray] = None) -> jnp.ndarray:
  """Eval-mode representations [num_rows, d] of the client's first `count` rows (zeros after), in `passes`
  (traced) passes of `chunk` rows: a chunk of clients runs as many passes as its largest one needs. With
  `weights` [num_rows, K], their weighted sums W^T R [K, d] instead, added up pass by pass (no row is kept)."""
  size = -(-rows.num_rows // chunk) * chunk

  def reps_of(p):
    index = p * chunk + jnp.arange(chunk)
    reps = forward(model, params, model_state, rows.pick(index)[0], False)[1].astype(jnp.float32)
    return index, jnp.where((index < count)[:, None], reps, 0.0)

  if weights is not None:
    padded = jnp.pad(weights, ((0, size - rows.num_rows), (0, 0)))

    def add(p, sums):
      index, reps = reps_of(p)
      return sums + jax.lax.dynamic_slice_in_dim(padded, p * chunk, chunk).T @ reps
    return jax.lax.fori_loop(0, passes, add, jnp.zeros((weights.shape[1], model.feature_dim)))

  def put(p, buf):
    return jax.lax.dynamic_update_slice_in_dim(buf, reps_of(p)[1], p * chunk, 0)
  return jax.lax.fori_loop(0, passes, put, jnp.zeros((size, model.feature_dim)))[:rows.num_rows]


def program_representations(program: ClientProgram, carry: Any, reps_of: Callable[[Optional[jnp.ndarray]], Any],
                            rows: ClientRows, broadcast: Any, key: jax.Array) -> Optional[jnp.ndarray]:
  """What `final` reads as rows.reps: None for a program without `trained`; reps_of(W) with W its
  `representation_weights` (rows without representations, `final`'s key), else reps_of(None)."""
  if program.trained is None:
    return None
  if program.representation_weights is None:
    return reps_of(None)
  return reps_of(program.representation_weights(carry, rows, broadcast, key))


def run_client_rows(program: ClientProgram, model: HeteroClassifier, client: ClientState, rows: RowsOf,
                    broadcast: Any, rng: jax.Array, trips: jnp.ndarray, rep_passes, rep_chunk: int, unroll: int = 1,
                    train: bool = True) -> tuple[ClientState, Any, jnp.ndarray]:
  """ONE client's round on its rows in a flat store, what the vmap executor maps over a chunk of clients: prepare
  -> init -> each stage's valid steps -> representations if the program reads them -> final, as `run_client`.

  The loops run a chunk's largest counts (traced, the same for every client of the chunk): trips [stages] steps
  per stage and `rep_passes` representation passes; step j of a stage is the client's j-th valid slot
  (`plan.slot_of_step`), masked past its own count. `unroll` steps run per loop iteration. With train=False no
  step is traced: the results have the same shapes and types, for `jax.eval_shape` at a fraction of the trace."""
  keys = client_keys(rng)
  x_view, y_view = rows.view()  # read by prepare / final where they read rows (else compiled away)
  start = without_model(program, client)
  if program.prepare is not None:
    start = program.prepare(start, client_rows(program, x_view, y_view, rows.n), broadcast, keys['prepare'])
  carry = program.init(start, broadcast, keys['init'])
  total, count = 0.0, 0
  for plan in plan_stages(program, rows.num_rows) if train else ():
    if not plan.length:  # a stage of 0 epochs (GeFL's synthetic-only rounds have no real epochs)
      continue
    key = stage_key(keys['train'], plan.index)
    schedule, steps = plan.schedule(key, rows.n), plan.valid(rows.n).sum()

    def body(i, state, plan=plan, schedule=schedule, key=key, steps=steps):
      for u in range(unroll):
        j = i * unroll + u
        step = lambda c: step_on_rows(plan, c, slot_of_step(plan, rows.n, j), schedule, rows.pick, rows.n,
                                      broadcast, key)
        carry, loss = masked(step, state[0], j < steps)
        state = (carry, state[1] + loss)
      return state
    carry, stage_total = jax.lax.fori_loop(0, -(-trips[plan.index] // unroll), body, (carry, 0.0))
    total, count = total + stage_total, count + steps
  trained = program.trained(carry) if program.trained is not None else None
  reps = program_representations(program, carry, lambda weights: represent_flat(
      model, trained.params, trained.model_state, rows, program.training.statistics_rows(rows.n), rep_passes,
      rep_chunk, weights), client_rows(program, x_view, y_view, rows.n), broadcast, keys['final'])
  out, upload = program.final(carry, client_rows(program, x_view, y_view, rows.n, reps), broadcast, keys['final'])
  return with_model(program, out, client), upload, total / jnp.maximum(count, 1)


def score_client_rows(evaluation: Evaluation, client: ClientState, broadcast: Any, rows: RowsOf, passes,
                      chunk: int) -> jnp.ndarray:
  """Correct predictions [len(names)] of one client on its test rows in a flat store, in `passes` (traced)
  passes of `chunk` rows (`score_client`)."""
  evaluated = prepare_evaluation(evaluation, client, broadcast)

  def one(p, counts):
    row, valid = pass_window(p * chunk, chunk, rows.num_rows, rows.n)
    x, y = rows.pick(row)
    return counts + correct_counts(evaluation, evaluated, x, y, valid).astype(counts.dtype)
  return jax.lax.fori_loop(0, passes, one, jnp.zeros(len(evaluation.names), jnp.int32))


def client_statistics_rows(evaluation: Evaluation, training: LocalTraining, client: ClientState, broadcast: Any,
                           rows: RowsOf, passes, chunk: int, key: jax.Array) -> Any:
  """The evaluation's statistics summed over one client's training rows in a flat store, in `passes` (traced)
  batches of `chunk` rows of its shuffled, augmented order (`client_statistics`; passes past its rows add
  nothing)."""
  evaluated = prepare_evaluation(evaluation, client, broadcast)
  order = statistics_order(key, rows.n, rows.num_rows)

  def one(p, sums):
    row, valid = statistics_batch(order, p, chunk, rows.n)
    return statistics_of_batch(evaluation, training, sums, evaluated, rows.pick(row)[0], valid, key, p)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      evaluation.statistics, evaluated, rows.pick(jnp.arange(chunk))[0], jnp.ones(chunk, bool)))
  return jax.lax.fori_loop(0, passes, one, zeros)
