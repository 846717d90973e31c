"""The tiny experiment that the end-to-end tests run (train_and_evaluate in a workdir), and reading its metrics."""

import json
import os
from dataclasses import replace
from typing import NamedTuple

import jax

from conftest import compilations
from fedjax_het.run.config import ExperimentConfig

CFG = ExperimentConfig(dataset='synthetic:8,8,1', num_clients=4, alpha=0.5, models=('mlp', 'small_cnn_narrow'),
                       feature_dim=16, rounds=4, batch_size=16, local_learning_rate=0.05, checkpoint_every=2,
                       join_ratio=0.5)


def _fault_runs() -> dict:
  """name -> (tiny config of a multi-phase method with a checkpoint every round, the round inside which
  tests/fault_driver.py kills it): each kill falls inside a phase, after a checkpoint of that phase."""
  from fedjax_het.methods import FedVTCConfig, FeloConfig, GeFLConfig, GeFLFConfig
  gefl = ExperimentConfig(algorithm='gefl', dataset='synthetic:32,32,1', data_fraction=0.25, num_clients=4,
                          partition='iid', models=('gefl_mnist_cnn1',), feature_dim=16, rm='fc', rounds=2,
                          batch_size=64, local_learning_rate=0.05, eval_protocol='global', data_order='shuffle',
                          checkpoint_every=1)
  with_gefl = lambda **kw: replace(gefl, methods={'gefl': GeFLConfig(ka_rounds=2, generator_epochs=1, **kw)})
  return {
      # knowledge rounds 1-2, target rounds 3-4: killed in round 2, resumed from round 1 across the boundary
      'gefl_dcgan': (with_gefl(generator='dcgan', width=4), 2),
      'gefl_cvae': (with_gefl(generator='cvae', width=4, latent=3), 2),
      'gefl_ddpm': (with_gefl(generator='ddpm', width=8, diffusion_steps=10), 2),
      # update mode: knowledge round 1, target rounds 2-3 that train the generator too
      'gefl_update': (with_gefl(generator='dcgan', width=4, mode='update'), 3),
      # warm-up 1, knowledge 2, target 3
      'gefl_f': (replace(gefl, algorithm='gefl_f', models=('gefl_fmnist_cnn1', 'gefl_fmnist_cnn2'), rounds=1,
                         methods={'gefl_f': GeFLFConfig(generator='cvae', fe_rounds=1, ka_rounds=1,
                                                        generator_epochs=1, warmup_epochs=1, width=4, latent=3)}), 3),
      'felo': (replace(CFG, algorithm='felo', models=('mlp',), checkpoint_every=1,
                       methods={'felo': FeloConfig(warmup=0.5)}), 3),
      'fedhe': (replace(CFG, algorithm='fedhe', models=('mlp',), checkpoint_every=1), 3),
      # fl round 1, vtc_exchange round 2, the fine-tuning round 3
      'fedvtc_finetune': (replace(CFG, algorithm='fedvtc', models=('small_cnn_narrow',), feature_dim=80, rm='fc',
                                  rounds=1, checkpoint_every=1, join_ratio=1.0,
                                  methods={'fedvtc': FedVTCConfig(samples_per_class=8, finetune_epochs=2)}), 3),
  }


FAULT_RUNS = _fault_runs()


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
  with compilations() as events:
    for _ in range(rounds):
      events.clear()
      state, m = fed.round(state)
      m.update(fed.evaluate(state))
      # The next round donates (deletes) this state's buffers: a copy (device_put compiles nothing; jnp.copy leaf by
      # leaf compiled a program per leaf shape).
      states.append(jax.device_put(state, may_alias=False))
      history.append({k: v for k, v in m.items() if 'seconds' not in k})
      compiles.append(len(events))
  return Recorded(states, history, compiles)
