"""The tiny experiment that the end-to-end tests run (train_and_evaluate in a workdir), and reading its metrics."""

import json
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.config import ExperimentConfig

CFG = ExperimentConfig(dataset='synthetic:8,8,1', num_clients=4, alpha=0.5, models=('mlp', 'small_cnn_narrow'),
                       feature_dim=16, rounds=4, batch_size=16, local_learning_rate=0.05, checkpoint_every=2,
                       join_ratio=0.5)


def metric_rows(workdir) -> list[dict]:
  """metrics.jsonl without its timings (which differ between otherwise identical runs)."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if 'seconds' not in k} for line in f]


def run_rounds(fed, state, rounds: int):
  """`rounds` rounds of a Federation from `state`, each evaluated: (state, metrics per round without timings)."""
  recorded = record_rounds(fed, state, rounds)
  return (recorded.states[-1] if rounds else state), recorded.history


class Recorded(NamedTuple):
  """A recorded run: the state after each round, the metrics of each round (without timings), and how many
  functions XLA compiled during each round and its evaluation."""
  states: list
  history: list
  compiles: list


def record_rounds(fed, state, rounds: int) -> Recorded:
  """`rounds` rounds of a Federation from `state`, each evaluated, with every state and compilation count kept."""
  states, history, compiles = [], [], []
  events = []
  listener = lambda event, duration, **kw: events.append(event) if 'backend_compile' in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    for _ in range(rounds):
      events.clear()
      state, m = fed.round(state)
      m.update(fed.evaluate(state))
      states.append(jax.tree.map(jnp.copy, state))  # the next round donates (deletes) this state's buffers
      history.append({k: v for k, v in m.items() if 'seconds' not in k})
      compiles.append(len(events))
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return Recorded(states, history, compiles)
