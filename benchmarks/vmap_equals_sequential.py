"""Every registered method run twice on a tiny federation, by the vmap executor with im2col convolutions (the CPU
default under vmap without oneDNN) and by the sequential executor: per metric and per state leaf max |vmap - sequential| / max |sequential|,
the largest of them over the per-round metrics and over the final client and server states, and whether every
state stays finite.

  python benchmarks/vmap_equals_sequential.py                       # XLA's default optimisation level
  XLA_FLAGS=--xla_backend_optimization_level=0 python benchmarks/vmap_equals_sequential.py --out_name=...level0

The test suite compiles at XLA:CPU's backend optimisation level 0 (faster compiles), where XLA miscompiles
FedVTC's vmapped round with im2col (docs/xla_cpu_miscompile.md); this sweep checks the executors at the level runs
use. Writes benchmarks/results/<out_name>.{json,csv}.
"""

import dataclasses
import os
import time

from absl import flags

from fedjax_het.run.cli import app_run

import jax
import numpy as np

from harness import RESULTS, write_results

from fedjax_het.methods import (CCVRConfig, FedDFConfig, FedGenConfig, FedGKTConfig, FedKDConfig, FedMDConfig,
                                FedMRLConfig, FedTGPConfig, FedVTCConfig, FeloConfig, FMLConfig, GeFLConfig, GeFLFConfig,
                                VeloConfig)
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation
from fedjax_het.run.registry import METHODS

flags.DEFINE_list('methods', None, 'Methods to check (default: every registered one).')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
flags.DEFINE_string('out_name', 'vmap_equals_sequential_cpu', 'Results file name (without extension).')
FLAGS = flags.FLAGS

# The tests' tiny settings: two architecture groups of 8x8 digits-like images (the golden federation's shapes);
# GeFL's family on 32x32 with GeFL's CNNs; FedVTC with p = 80 (its decoder's 8x8 shape).
BASE = ExperimentConfig(dataset='synthetic:8,8,1', num_clients=4, alpha=0.5, models=('small_cnn_narrow', 'mlp'),
                        feature_dim=16, rounds=2, batch_size=8, local_learning_rate=0.05, join_ratio=0.5,
                        eval_protocol='global', checkpoint_every=0,
                        methods=dict(fedtgp=FedTGPConfig(server_epochs=2),
                                     fedgen=FedGenConfig(server_epochs=2, generator_learning_rate=0.005),
                                     fml=FMLConfig(global_model='small_cnn_narrow'),
                                     fedkd=FedKDConfig(global_model='small_cnn_narrow'),
                                     fedmrl=FedMRLConfig(sub_feature_dim=8, global_model='small_cnn_narrow'),
                                     ccvr=CCVRConfig(virtual_per_class=16, calibration_epochs=2)))
GEFL = dict(dataset='synthetic:32,32,1', partition='iid', models=('gefl_mnist_cnn1', 'gefl_mnist_cnn2'), rm='none',
            batch_size=64, data_order='shuffle', drop_last=False)
SPECIAL = {
    'fedvtc': dict(models=('small_cnn_narrow',), feature_dim=80, rm='fc', batch_size=32, local_learning_rate=0.01,
                   rounds=1, methods={'fedvtc': FedVTCConfig(samples_per_class=8, finetune_epochs=2)}),
    'gefl': dict(GEFL, methods={'gefl': GeFLConfig(ka_rounds=2, generator_epochs=1, width=4)}),
    'gefl_f': dict(GEFL, models=('gefl_fmnist_cnn1', 'gefl_fmnist_cnn2'), rounds=1,
                   methods={'gefl_f': GeFLFConfig(generator='cvae', fe_rounds=1, ka_rounds=1, generator_epochs=1,
                                                  warmup_epochs=1, width=4, latent=3)}),
    'lg_fedavg_fb': dict(GEFL),
    'felo': dict(rounds=4, methods={'felo': FeloConfig(warmup=0.25)}),
    'velo': dict(rounds=4, methods={'velo': VeloConfig(warmup=0.25, feature_store=16, hidden=16, latent=8,
                                                       embedding=8, upload_rows=24, epochs=1, batch_size=8)}),
    'fedhe': dict(rounds=4),
    'fedmd': dict(public_size=40, methods={'fedmd': FedMDConfig(transfer_public_epochs=1, transfer_private_epochs=1,
                                                                digest_batch_size=8)}),
    'feddf': dict(public_size=40, methods={'feddf': FedDFConfig(server_steps=4, server_batch_size=8)}),
    # HeteroFL's momentum SGD on these images amplifies float differences: its first round of 20 steps ends equal
    # to 1e-5 under both executors, and its second turns a 1e-5 perturbation of the server model into O(1)
    # parameter differences under the sequential executor alone, so its second-round row measures that
    # sensitivity, not the executors (at 125 steps a round even the first round diverges).
    'heterofl': dict(models=('heterofl_conv@0.125', 'heterofl_conv@0.0625'), rm='none', local_steps=20),
    'fedgkt': dict(models=('mlp',), methods={'fedgkt': FedGKTConfig(server_epochs=1, server_blocks=1)}),
}


def config(name: str) -> ExperimentConfig:
  extra = dict(SPECIAL.get(name, {}))
  methods = extra.pop('methods', {})
  return dataclasses.replace(BASE, algorithm=name, methods={**BASE.methods, **methods}, **extra)


def run(cfg: ExperimentConfig):
  fed = build_federation(cfg)
  state = fed.init()
  history = []
  for _ in range(fed.total_rounds):
    state, metrics = fed.round(state)
    metrics.update(fed.evaluate(state))
    history.append({k: float(v) for k, v in metrics.items() if np.ndim(v) == 0 and 'seconds' not in k
                    and isinstance(v, (int, float, np.floating, np.integer, jax.Array))})
  leaves = [np.asarray(a, np.float64) for a in jax.tree.leaves((state.groups, state.server))
            if np.issubdtype(np.asarray(a).dtype, np.floating)]
  return history, leaves


def relative(a, b) -> float:
  """max |a - b| / max |b| (nan when either holds a non-finite value)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not (np.isfinite(a).all() and np.isfinite(b).all()):
    return float('nan')
  return float(np.max(np.abs(a - b), initial=0.0) / max(float(np.max(np.abs(b), initial=0.0)), 1e-12))


def main(_):
  level = 0 if '--xla_backend_optimization_level=0' in os.environ.get('XLA_FLAGS', '').split() else 'default'
  rows = []
  for name in FLAGS.methods or list(METHODS):
    cfg = config(name)
    start = time.perf_counter()
    try:
      seq_hist, seq_leaves = run(dataclasses.replace(cfg, strategy='sequential', conv='im2col'))
      vm_hist, vm_leaves = run(dataclasses.replace(cfg, strategy='vmap', conv='im2col'))
    except Exception as e:  # a refusal (e.g. the level-0 guard) is a row, not a stop
      rows.append({'method': name, 'xla_level': level, 'error': f'{type(e).__name__}: {e}'.splitlines()[0]})
      print(rows[-1], flush=True)
      continue
    keys = sorted(set.intersection(*[set(h) for h in seq_hist + vm_hist]))
    metrics = max(relative([h[k] for h in vm_hist], [h[k] for h in seq_hist]) for k in keys)
    states = max((relative(a, b) for a, b in zip(vm_leaves, seq_leaves)), default=0.0)
    rows.append({'method': name, 'xla_level': level, 'rounds': len(seq_hist),
                 'metrics_max_rel_diff': metrics, 'state_max_rel_diff': states,
                 'finite': bool(all(np.isfinite(a).all() for a in vm_leaves)),
                 'seconds': round(time.perf_counter() - start, 1)})
    print(rows[-1], flush=True)
  write_results(FLAGS.out, FLAGS.out_name, {'xla_level': level}, rows)


if __name__ == '__main__':
  app_run(main)
