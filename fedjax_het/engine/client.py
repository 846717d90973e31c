"""One client's round and one client's score as pure functions on device: what the vmap executor maps over a
group. Both run the plan of `engine.plan`, which the sequential executor runs from the host instead."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_het.core import ClientProgram, ClientState, Evaluation, with_model, without_model
from fedjax_het.data.federated import ClientArrays
from fedjax_het.engine.plan import (client_keys, client_rows, count_into, even_chunk, masked, plan_stages,
                                    represent_into, stage_key, statistics_into, take_step, zero_statistics)
from fedjax_het.models.classifier import HeteroClassifier


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
  reps = None
  if program.trained is not None:
    trained = program.trained(carry)
    reps = represent_rows(model, trained.params, trained.model_state, data.x, rep_chunk)
  out, upload = program.final(carry, client_rows(program, data.x, data.y, data.n, reps), broadcast, keys['final'])
  return with_model(program, out, client), upload, total / jnp.maximum(count, 1)


def score_client(evaluation: Evaluation, client: ClientState, broadcast: Any, test: ClientArrays, chunk: int
                 ) -> jnp.ndarray:
  """Correct predictions [len(names)] of one client on its padded test rows, in passes of at most `chunk` rows
  (`count_into`). Pure."""
  evaluated = evaluation.prepare(client, broadcast)
  n_max = test.x.shape[0]
  chunk = even_chunk(n_max, chunk)
  counts = jnp.zeros(len(evaluation.names), jnp.int32)
  return jax.lax.fori_loop(0, -(-n_max // chunk), lambda c, counts: count_into(
      evaluation, counts, evaluated, test.x, test.y, c * chunk, chunk, test.n), counts)


def client_statistics(evaluation: Evaluation, client: ClientState, broadcast: Any, train: ClientArrays, chunk: int
                      ) -> Any:
  """The evaluation's statistics (`Evaluation.statistics`) summed over one client's training rows, in batches of
  `chunk` rows from its first (the last one shorter), whatever the group's padding. Pure."""
  evaluated = evaluation.prepare(client, broadcast)
  n_max = train.x.shape[0]
  chunk = min(chunk, n_max)
  return jax.lax.fori_loop(0, -(-n_max // chunk), lambda c, sums: statistics_into(
      evaluation, sums, evaluated, train.x, c * chunk, chunk, train.n), zero_statistics(evaluation, evaluated,
                                                                                        train.x, chunk))
