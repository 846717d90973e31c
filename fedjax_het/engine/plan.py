"""The plan of a client's local work, which every executor consumes: per stage of its `ClientProgram`, the step
slots (epochs x slots per epoch, fixed per group), which of them a client of n rows takes (`StagePlan.valid`), the
rows each slot reads (`StagePlan.schedule`), its key, and the `Batch` it builds (`take_step`). The vmap executor
scans every slot of a plan with the invalid ones masked; the sequential executor runs the same `take_step` on the
valid slots only. Representations and scores are computed chunk by chunk by `represent_into` and `count_into`,
which both executors call (in a loop on device, or from the host).

The same arithmetic counts a round's local work (`StagePlan.rows`), so the logged steps and samples are the steps
the executors take.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import Batch, ClientProgram, ClientRows, Evaluation, Stage
from fedjax_het.data.augment import augment_batch
from fedjax_het.local_training import LocalTraining, batch_row_mask, batch_schedule, step_key
from fedjax_het.models.forward import forward
from fedjax_het.rows import shuffled_real_rows


def client_keys(rng: jax.Array) -> dict:
  """The keys of one client's round, from its round key fold_in(round key, client id): prepare, init, the local
  steps (stage k's: `stage_key`) and final."""
  return {'init': jax.random.fold_in(rng, 3), 'train': jax.random.fold_in(rng, 1),
          'final': jax.random.fold_in(rng, 2), 'prepare': jax.random.fold_in(rng, 4)}


@jax.jit
def round_client_keys(round_key: jax.Array, client_id) -> dict:
  """`client_keys` of client `client_id` in the round of `round_key` (fold_in(round key, client id)), in one program
  for the sequential executor, which calls it from the host once per client."""
  return client_keys(jax.random.fold_in(round_key, client_id))


def client_rows(program: ClientProgram, x: jnp.ndarray, y: jnp.ndarray, n, reps=None) -> ClientRows:
  """What a client's `prepare` and `final` see of its rows x [n_max, ...], y [n_max] (n real): `ClientRows` with
  the rows a statistics pass visits (`LocalTraining.statistics_rows`) and the representations where given."""
  return ClientRows(x, y, program.training.statistics_rows(n), n, reps)


def stage_key(train_key: jax.Array, stage: int) -> jax.Array:
  """The key of stage `stage`'s local steps and schedule: the round's training key for the first stage (so a
  one-stage program draws what it always drew), fold_in(train key, 1000 + stage) for later ones."""
  return train_key if stage == 0 else jax.random.fold_in(train_key, 1000 + stage)


def _xp(n):
  """numpy for host values (the sequential executor plans on the host, without reading the device), jnp for
  traced ones."""
  return jnp if isinstance(n, jax.Array) else np


def stage_steps_per_epoch(training: LocalTraining, stage: Stage, n):
  """Local steps per epoch of `stage` for a client of n training rows: n // B of real rows (ceil(n / B) without
  drop_last; the generated rows in place of n under `LocalTraining.rows`); max(1, n // B) for a generated stage
  whatever the batching rule (GeFL's code: floor(n_k / B) synthetic steps, one of n_k samples when n_k < B)."""
  if not stage.generated:
    return training.steps_per_epoch(n)
  return _xp(n).maximum(n // training.batch_size, 1)


class StagePlan(NamedTuple):
  """One stage's step slots for a group whose clients hold at most n_max rows (`plan_stages`).

  index: the stage's place in its program; slots: step slots per epoch; length: slots in the plan (epochs *
  slots, or the first --local_steps slots of a one-epoch stage, which a client's valid slots lead); n_max: the rows
  a schedule is laid over (the group's padded rows, or the program's generated rows).
  """
  stage: Stage
  training: LocalTraining
  index: int
  slots: int
  length: int
  n_max: int

  def rows_of(self, n):
    """The rows the stage's schedule runs over: the client's n, or the program's generated rows."""
    return self.training.rows if self.training.rows is not None else n

  def valid(self, n):
    """[length] which slots a client of n training rows takes: the first stage_steps_per_epoch of each epoch,
    then only the first --local_steps of those (numpy for a host n, jnp for a traced one)."""
    xp = _xp(n)
    slot = xp.arange(self.length)
    valid = slot % self.slots < stage_steps_per_epoch(self.training, self.stage, self.rows_of(n))
    if self.training.max_steps is not None:
      valid = valid & (xp.cumsum(valid) <= self.training.max_steps)
    return valid

  def rows(self, n):
    """[length] the real rows each slot trains on (0 for slots the client does not take), for counting samples:
    B under drop_last; the rows left in the epoch's last batch without it; min(n, B) in a generated stage."""
    xp, batch = _xp(n), self.training.batch_size
    if self.stage.generated:
      per_slot = xp.minimum(n, batch)
    elif self.training.drop_last:
      per_slot = batch
    else:
      per_slot = xp.clip(self.rows_of(n) - (xp.arange(self.length) % self.slots) * batch, 0, batch)
    return xp.where(self.valid(n), per_slot, 0)

  def schedule(self, key: jax.Array, n) -> Optional[jnp.ndarray]:
    """Row indices [length, B] of each slot (`batch_schedule` from fold_in(stage key, 0)); None for a generated
    stage, whose batches hold no rows."""
    if self.stage.generated:
      return None
    t = self.training
    idx, _ = batch_schedule(jax.random.fold_in(key, 0), self.rows_of(n), self.n_max, t.batch_size,
                            self.stage.epochs, t.order, t.drop_last)
    return idx[:self.length]


def plan_stages(program: ClientProgram, n_max: int) -> tuple[StagePlan, ...]:
  """The plan of each stage of `program` for a group padded to n_max training rows, each under its own schedule
  (`Stage.training`, else the program's)."""
  plans = []
  for k, stage in enumerate(program.stages):
    training = stage.training or program.training
    rows = training.rows if training.rows is not None else n_max
    slots = training.slots(rows)
    length = stage.epochs * slots
    if training.max_steps is not None and stage.epochs == 1:
      length = min(length, training.max_steps)
    plans.append(StagePlan(stage, training, k, slots, length, rows))
  return tuple(plans)


def take_step(plan: StagePlan, carry: Any, t, schedule: Optional[jnp.ndarray], x: jnp.ndarray, y: jnp.ndarray,
              n, broadcast: Any, key: jax.Array, client=None) -> tuple[Any, jnp.ndarray]:
  """Slot t of a stage on padded rows x, y (client `client` of stacked x and y when given): `step_on_rows`."""
  pick = (lambda rows: (x[rows], y[rows])) if client is None else (lambda rows: (x[client, rows], y[client, rows]))
  return step_on_rows(plan, carry, t, schedule, pick, n, broadcast, key)


def step_on_rows(plan: StagePlan, carry: Any, t, schedule: Optional[jnp.ndarray], pick, n, broadcast: Any,
                 key: jax.Array) -> tuple[Any, jnp.ndarray]:
  """Slot t of a stage: its `Batch` (rows schedule[t], read by pick(rows) -> (x, y); row ids only under
  `LocalTraining.rows`; none in a generated stage; `Batch.mask` marks the real rows of a partial batch), its key
  (`step_key`: epoch t // slots, step t % slots of the stage key) and the stage's step."""
  training, batch_size = plan.training, plan.training.batch_size
  epoch, slot = t // plan.slots, t % plan.slots
  if plan.stage.generated:
    batch = Batch(None, None, None, jnp.arange(batch_size) < n)
  else:
    rows = schedule[t]
    mask = None if training.drop_last else batch_row_mask(slot, plan.rows_of(n), batch_size)
    if training.rows is not None:
      batch = Batch(None, None, rows, mask)
    else:
      x, y = pick(rows)
      batch = Batch(augment_batch(x, step_key(key, epoch, slot), training.augment, training.augment_fill), y, rows,
                    mask)
  return plan.stage.step(carry, batch, broadcast, step_key(key, epoch, slot))


def slot_of_step(plan: StagePlan, n, j):
  """The slot of a client's j-th valid step in the stage (j < its `StagePlan.valid` count): step j % s of epoch
  j // s, for s its steps per epoch. A loop over j visits exactly the valid slots, in order."""
  per_epoch = _xp(n).maximum(stage_steps_per_epoch(plan.training, plan.stage, plan.rows_of(n)), 1)
  return (j // per_epoch) * plan.slots + j % per_epoch


def step_counts(program: ClientProgram, num_rows: int, n: np.ndarray) -> np.ndarray:
  """[clients, stages] the valid steps of each stage for clients of n [clients] training rows (host numbers), the
  stages planned over `num_rows` rows."""
  plans = plan_stages(program, num_rows)
  return np.asarray([[int(p.valid(int(k)).sum()) if p.length else 0 for p in plans] for k in np.asarray(n)],
                    np.int64).reshape(len(n), len(plans))


def pass_window(start, chunk: int, num_rows: int, n):
  """(row ids [chunk], which of them count) of a pass of `chunk` rows from `start` over a client of n rows held in
  `num_rows` padded rows: near the end the window is clamped to end at num_rows (as dynamic_slice clamps) and
  counts only its new rows, so every pass reads the rows a padded array would give it."""
  first = jnp.minimum(start, max(num_rows - chunk, 0))
  row = first + jnp.arange(chunk)
  return row, (row >= start) & (row < n)


def masked(step, carry: Any, valid) -> tuple[Any, jnp.ndarray]:
  """step(carry), or the carry unchanged and a loss of 0 when the slot is not valid."""
  new, loss = step(carry)
  return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, carry), jnp.where(valid, loss, 0.0)


def even_chunk(rows: int, max_chunk: int) -> int:
  """The smallest chunk that covers `rows` in as few passes of at most `max_chunk` rows (288 rows with at most
  256 per pass: 2 x 144, not 256 + a clamped 256 that recomputes 224 rows)."""
  passes = -(-max(rows, 1) // max(max_chunk, 1))
  return -(-max(rows, 1) // passes)


def represent_into(model, buf: jnp.ndarray, params: Any, model_state: Any, x: jnp.ndarray, start, chunk: int
                   ) -> jnp.ndarray:
  """buf [n_max, d] with rows [start, start + chunk) replaced by their eval-mode representations under (params,
  model_state). Near the end dynamic_slice and dynamic_update_slice clamp the start alike, so the last chunk
  recomputes a few rows instead of reading past n_max."""
  rows = jax.lax.dynamic_slice_in_dim(x, start, chunk)
  reps = forward(model, params, model_state, rows, False)[1]
  return jax.lax.dynamic_update_slice_in_dim(buf, reps.astype(buf.dtype), start, 0)


STATISTICS_STREAM = 0x535441  # folded into a round's clients' key for the statistics pass (`statistics_key`)


@jax.jit  # one program where the sequential executor calls it from the host, once per client
def statistics_key(clients_key: jax.Array, client_id) -> jax.Array:
  """The key of one client's statistics pass (`Evaluation.statistics`) after a round: fold_in(fold_in(the round's
  clients' key, STATISTICS_STREAM), client id), so the pass draws nothing that the client's training draws."""
  return jax.random.fold_in(jax.random.fold_in(clients_key, STATISTICS_STREAM), client_id)


def statistics_order(key: jax.Array, n, num_rows: int) -> jnp.ndarray:
  """[num_rows] the order in which a statistics pass visits a client's rows: its n real rows shuffled by
  fold_in(key, 0), padding last (a shuffled train loader's, as HeteroFL's `stats` pass; in stored order the rows of
  a client are often grouped by class, and batches of one class leave the between-class spread out of every batch
  variance)."""
  return shuffled_real_rows(jax.random.fold_in(key, 0), jnp.arange(num_rows) < n)


def statistics_batch(order: jnp.ndarray, p, chunk: int, n) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(row ids [chunk], which of them count) of batch p of a statistics pass over a client's rows in `order`
  (`statistics_order`): positions p * chunk ... of the order, counted while < n (the last batch shorter)."""
  position = p * chunk + jnp.arange(chunk)
  return order[jnp.minimum(position, order.shape[0] - 1)], position < n


def statistics_of_batch(evaluation: Evaluation, training: LocalTraining, sums: Any, evaluated: Any,
                        x: jnp.ndarray, valid: jnp.ndarray, key: jax.Array, p) -> Any:
  """sums plus the evaluation's statistics of batch p, x [chunk, ...] with its real rows `valid`, augmented as the
  client's training batches are (`LocalTraining.augment`, from fold_in(key, p + 1): HeteroFL's `stats` reads its
  train loader, crop and flip included)."""
  x = augment_batch(x, jax.random.fold_in(key, p + 1), training.augment, training.augment_fill)
  return jax.tree.map(jnp.add, sums, evaluation.statistics(evaluated, x, valid))


def zero_statistics(evaluation: Evaluation, evaluated: Any, x: jnp.ndarray, chunk: int) -> Any:
  """Zeros shaped like the evaluation's statistics of a batch of `chunk` rows of x (what `statistics_into` adds
  to)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(
      evaluation.statistics, evaluated, x[:chunk], jnp.ones(chunk, bool)))


def count_into(evaluation: Evaluation, counts: jnp.ndarray, evaluated: Any, x: jnp.ndarray, y: jnp.ndarray, start,
               chunk: int, n) -> jnp.ndarray:
  """counts [len(names)] plus the correct predictions of each of the evaluation's predictions on rows [start,
  start + chunk) of test rows x, y that are among the first n (a clamped last chunk counts only its new rows)."""
  first = jnp.minimum(start, x.shape[0] - chunk)  # where dynamic_slice reads when clamped
  xs = jax.lax.dynamic_slice_in_dim(x, first, chunk)
  ys = jax.lax.dynamic_slice_in_dim(y, first, chunk)
  row = first + jnp.arange(chunk)
  valid = (row >= start) & (row < n)
  return counts + correct_counts(evaluation, evaluated, xs, ys, valid).astype(counts.dtype)


def correct_counts(evaluation: Evaluation, evaluated: Any, x: jnp.ndarray, y: jnp.ndarray, valid: jnp.ndarray
                   ) -> jnp.ndarray:
  """[len(names)] correct predictions of each of the evaluation's predictions on the rows of x, y where valid."""
  logits = evaluation.logits(evaluated, x, valid) if evaluation.batch_rows else evaluation.logits(evaluated, x)
  return jnp.stack([jnp.sum((jnp.argmax(z, -1) == y) & valid) for z in logits])
