"""The tiny experiment that the end-to-end tests run (train_and_evaluate in a workdir), and reading its metrics."""

import json
import os

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
  history = []
  for _ in range(rounds):
    state, m = fed.round(state)
    m.update(fed.evaluate(state))
    history.append({k: v for k, v in m.items() if 'seconds' not in k})
  return state, history
