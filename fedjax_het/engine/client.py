"""One client's round and one client's score as pure functions: what the vmap executor maps over a group (the
sequential executor runs the same program functions one jitted piece at a time)."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fedjax_het.core import (Batch, ClientProgram, ClientRows, ClientState, Evaluation, program_stages, stage_key,
                             stage_steps_per_epoch, with_model, without_model)
from fedjax_het.data.federated import ClientArrays
from fedjax_het.local_training import batch_row_mask, batch_schedule, cap_schedule, step_key
from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.forward import forward


def client_keys(rng: jax.Array) -> dict:
  """The keys of one client's round, from its round key fold_in(round key, client id): init, the local steps
  (schedule: fold_in(train, 0); step s of epoch e: `step_key(train, e, s)`) and final."""
  return {'init': jax.random.fold_in(rng, 3), 'train': jax.random.fold_in(rng, 1), 'final': jax.random.fold_in(rng, 2)}


def masked_step(step: Callable, carry: Any, batch: Batch, broadcast: Any, key: jax.Array, valid
                ) -> tuple[Any, jnp.ndarray]:
  """step(carry, batch, broadcast, key), or the carry unchanged and a loss of 0 when the step slot is padding."""
  new, loss = step(carry, batch, broadcast, key)
  return jax.tree.map(lambda a, b: jnp.where(valid, a, b), new, carry), jnp.where(valid, loss, 0.0)


def represent_rows(model: HeteroClassifier, params: Any, model_state: Any, x: jnp.ndarray, chunk: int
                   ) -> jnp.ndarray:
  """Eval-mode representations [n_max, d] of all rows of one client's x [n_max, ...], `chunk` rows at a time
  (n_max padded up to a multiple of `chunk` internally and cut back after). Pure and vmappable."""
  return map_rows(lambda xc: forward(model, params, model_state, xc, False)[1], x, chunk)


def map_rows(fn, x: jnp.ndarray, chunk: int) -> Any:
  """fn over x [n_max, ...] in chunks of `chunk` rows (a lax.map), outputs concatenated back to n_max rows."""
  n_max = x.shape[0]
  chunk = max(1, min(chunk, n_max))
  pad = (-n_max) % chunk
  xp = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
  out = jax.lax.map(fn, xp.reshape((-1, chunk) + x.shape[1:]))
  return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:])[:n_max], out)


def run_client(program: ClientProgram, model: HeteroClassifier, client: ClientState, data: ClientArrays,
               broadcast: Any, rng: jax.Array, rep_chunk: int = 256, unroll: int | bool = 1
               ) -> tuple[ClientState, Any, jnp.ndarray]:
  """ONE client's round: init -> every local step slot of each stage in a lax.scan (padding slots masked) -> the
  eval-mode representations if the program reads them -> final. Returns (client, upload, mean loss of its real
  steps).

  `data` holds this client's padded rows (x [n_max, ...], y [n_max], n []); `unroll` is lax.scan's."""
  keys, training = client_keys(rng), program.training
  carry = program.init(without_model(program, client), broadcast, keys['init'])
  rows_generated = training.rows is not None
  n, n_max = (training.rows, training.rows) if rows_generated else (data.n, data.x.shape[0])
  total, count = 0.0, 0
  for k, stage in enumerate(program_stages(program)):
    train_key = stage_key(keys['train'], k)
    slots = training.slots(n_max)
    if stage.generated:
      steps = jnp.arange(stage.epochs * slots)
      idx = jnp.zeros((steps.shape[0], 0), jnp.int32)
      valid = steps % slots < stage_steps_per_epoch(training, stage, n)
    else:
      idx, valid = batch_schedule(jax.random.fold_in(train_key, 0), n, n_max, training.batch_size,
                                  stage.epochs, training.order, training.drop_last)
    idx, valid = cap_schedule(idx, valid, training.max_steps, stage.epochs)

    def body(carry, step, stage=stage, slots=slots, train_key=train_key):
      s, rows, ok = step
      key = step_key(train_key, s // slots, s % slots)
      if stage.generated:
        batch = Batch(None, None, None, jnp.arange(training.batch_size) < n)
      else:
        mask = None if training.drop_last else batch_row_mask(s % slots, n, training.batch_size)
        batch = (Batch(None, None, rows, mask) if rows_generated
                 else Batch(data.x[rows], data.y[rows], rows, mask))
      return masked_step(stage.step, carry, batch, broadcast, key, ok)

    carry, losses = jax.lax.scan(body, carry, (jnp.arange(valid.shape[0]), idx, valid), unroll=unroll)
    total, count = total + losses.sum(), count + valid.sum()
  reps = None
  if program.trained is not None:
    trained = program.trained(carry)
    reps = represent_rows(model, trained.params, trained.model_state, data.x, rep_chunk)
  rows = ClientRows(data.x, data.y, training.statistics_rows(data.n), data.n, reps)
  out, upload = program.final(carry, rows, broadcast, keys['final'])
  return with_model(program, out, client), upload, total / jnp.maximum(count, 1)


def count_correct(evaluation: Evaluation, evaluated: Any, x: jnp.ndarray, y: jnp.ndarray, valid: jnp.ndarray
                  ) -> jnp.ndarray:
  """Correct predictions [len(names)] of each of the evaluation's predictions on the valid rows of a batch."""
  logits = evaluation.logits(evaluated, x)
  return jnp.stack([jnp.sum((jnp.argmax(z, -1) == y) & valid) for z in logits])


def score_client(evaluation: Evaluation, client: ClientState, broadcast: Any, test: ClientArrays, chunk: int
                 ) -> jnp.ndarray:
  """Correct predictions [len(names)] of one client on its padded test rows, `chunk` rows per pass. Pure."""
  evaluated = evaluation.prepare(client, broadcast)
  rows = jnp.arange(test.x.shape[0])
  n_max = test.x.shape[0]
  chunk = max(1, min(chunk, n_max))
  pad = (-n_max) % chunk
  split = lambda a: jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape((-1, chunk) + a.shape[1:])
  counts = jax.lax.map(lambda b: count_correct(evaluation, evaluated, *b),
                       (split(test.x), split(test.y), split(rows < test.n)))
  return counts.sum(0)
