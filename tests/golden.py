"""The golden run of tests/test_golden.py: one method, two rounds on a tiny two-group federation, its metrics and
a digest of its final state (sums of absolute values of the client and server leaves)."""

import jax
import numpy as np

from fedjax_het.core import parts
from fedjax_het.data import make_federated_data, make_synthetic
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.methods import (CCVRConfig, FedDFConfig, FedGenConfig, FedGKTConfig, FedKDConfig, FedMDConfig,
                                FedMRLConfig, FedTGPConfig, FedTypeConfig, FedVTCConfig, GeFLConfig, GeFLFConfig,
                                PFedAFMConfig, VeloConfig)
from fedjax_het.methods.fml import FMLConfig
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import make_algorithm

METHODS = ['fedre', 'local', 'fedavg', 'lg_fedavg', 'fedproto', 'fedgh', 'fedtgp', 'fd', 'fedgen', 'fml', 'fedkd',
           'fedmrl', 'fpl', 'ccvr', 'fedprox', 'fedhe', 'felo', 'velo', 'fedvtc', 'gefl', 'gefl_f', 'lg_fedavg_fb',
           'fedmd', 'feddf', 'avgkd', 'fedala', 'heterofl', 'fedgkt', 'pfedafm', 'fedtype']
TINY = dict(methods=dict(fedtgp=FedTGPConfig(server_epochs=2),
                         fedgen=FedGenConfig(server_epochs=2, generator_learning_rate=0.005),
                         fml=FMLConfig(global_model='small_cnn_narrow'),
                         fedkd=FedKDConfig(global_model='small_cnn_narrow'),
                         fedmrl=FedMRLConfig(sub_feature_dim=8, global_model='small_cnn_narrow'),
                         ccvr=CCVRConfig(virtual_per_class=16, calibration_epochs=2),
                         velo=VeloConfig(warmup=0.0, feature_store=16, hidden=16, latent=8, embedding=8,
                                         upload_rows=16, epochs=1, batch_size=12),
                         fedvtc=FedVTCConfig(samples_per_class=4, finetune_epochs=1),
                         gefl=GeFLConfig(generator='dcgan', ka_rounds=2, generator_epochs=1, width=4,
                                         mode='update'),
                         gefl_f=GeFLFConfig(generator='cvae', fe_rounds=1, ka_rounds=1, generator_epochs=1,
                                            warmup_epochs=1, width=4, latent=3),
                         fedmd=FedMDConfig(transfer_public_epochs=1, transfer_private_epochs=1, digest_batch_size=8),
                         feddf=FedDFConfig(server_steps=4, server_batch_size=8),
                         pfedafm=PFedAFMConfig(global_model='small_cnn_narrow'),
                         fedtype=FedTypeConfig(global_model='mlp'),
                         fedgkt=FedGKTConfig(server_epochs=1, server_blocks=1, optimizer='sgd', learning_rate=1e-5)),
            feature_dim=16, num_clients=6,
            batch_size=8, local_learning_rate=0.05, rounds=2)


# Methods whose federation differs from the tiny one: FedVTC's decoder needs g to end in Linear(L, p) (--rm=fc)
# of the VTC latent's width (80 on 8x8 images);
# GeFL's generators emit 32x32 images and GeFL-F and lg_fedavg_fb split GeFL's CNNs; FedMD and FedDF distil on 40
# public rows held out of the pool; HeteroFL's groups are one CNN at two widths. Each multi-phase method's
# run crosses every phase boundary (its rounds are the phases' total).
FEDERATIONS = {'fedvtc': dict(rm='fc', feature_dim=80),
               'gefl': dict(image=32, models=('gefl_mnist_cnn1', 'gefl_mnist_cnn2'), rm='none'),
               'gefl_f': dict(image=32, models=('gefl_fmnist_cnn1', 'gefl_fmnist_cnn2'), rm='fc'),
               'lg_fedavg_fb': dict(image=32, models=('gefl_mnist_cnn1', 'gefl_mnist_cnn2'), rm='none'),
               'fedmd': dict(public=40), 'feddf': dict(public=40),
               'heterofl': dict(models=('heterofl_conv@0.125', 'heterofl_conv@0.0625'), rm='none'),
               'fedgkt': dict(models=('mlp',))}  # see test_golden.UNPINNED_ACCURACY
ROUNDS = {'fedvtc': 1, 'gefl': 1, 'gefl_f': 1}


def tiny_data(image: int = 8, public: int = 0):
  ds = make_synthetic(num_samples=480, image_shape=(image, image, 1), num_classes=4, noise=0.3, seed=1)
  return make_federated_data(ds, num_clients=6, partition='dirichlet', seed=3, alpha=0.5, public_size=public)


def digest(tree) -> float:
  return float(sum(np.abs(np.asarray(a, np.float64)).sum() for a in jax.tree.leaves(tree)
                   if np.issubdtype(np.asarray(a).dtype, np.floating)))


# The last few golden runs (other tests check their method's properties on one instead of compiling a federation
# of their own). Bounded: a federation keeps its compiled programs, dozens of memory mappings each, and a process
# holding all 44 runs' programs reaches the kernel's limit on mappings (vm.max_map_count), where XLA segfaults.
_RUNS: dict = {}
_KEPT_RUNS = 2


def make_golden_federation(name: str, strategy: str = 'sequential', data=None) -> Federation:
  """The golden run's `Federation` of method `name`, not yet run."""
  settings = FEDERATIONS.get(name, {})
  if 'image' in settings or 'public' in settings or data is None:
    data = tiny_data(settings.get('image', 8), settings.get('public', 0))
  rounds = ROUNDS.get(name, 2)
  cfg = ExperimentConfig(algorithm=name, **{**TINY, 'rounds': rounds, 'feature_dim': settings.get('feature_dim', 16)})
  training = LocalTraining(0.05, 8, 1, drop_last=settings.get('drop_last', True))
  models = ModelConfig(settings.get('models', ('small_cnn_narrow', 'mlp')), settings.get('feature_dim', 16),
                       settings.get('rm', 'ap'))
  # The vmap runs take im2col convolutions, the CPU default under vmap without oneDNN, so they also
  # guard XLA:CPU's batched max-pool gradient at the suite's level 0 (docs/xla_cpu_miscompile.md).
  conv = 'xla' if strategy == 'sequential' else 'im2col'
  return Federation(make_algorithm(cfg, data), data, models, training,
                    ExecutionConfig(strategy=strategy, conv=conv, eval_batch_size=16), join_ratio=0.5, rounds=rounds)


def golden_federation(name: str, strategy: str = 'sequential', data=None):
  """(federation, final state, per-round metrics) of the golden run, computed once while among the last
  `_KEPT_RUNS` asked for."""
  if (name, strategy) not in _RUNS:
    while len(_RUNS) >= _KEPT_RUNS:
      del _RUNS[next(iter(_RUNS))]
    fed = make_golden_federation(name, strategy, data)
    state = fed.init()
    history = []
    for _ in range(fed.total_rounds):
      state, m = fed.round(state)
      m.update(fed.evaluate(state))
      history.append(m)
    _RUNS[(name, strategy)] = fed, state, history
  return _RUNS[(name, strategy)]


def client_state(fed, state, k: int):
  """Client k's state, taken out of its group's stack."""
  for g, stacked in zip(fed.groups, state.groups):
    if k in g.clients:
      i = int(np.flatnonzero(g.clients == k)[0])
      return jax.tree.map(lambda a: a[i], stacked)
  raise KeyError(k)


def golden_run(name: str, strategy: str = 'sequential', data=None) -> dict:
  """The golden run's metrics and parameter digests."""
  fed, state, history = golden_federation(name, strategy, data)
  m = history[-1]
  rounds = [{k: v for k, v in h.items() if isinstance(v, (int, float)) and not k.endswith('seconds')}
            for h in history]
  # Parameters of the client's own model and of its extra modules (a companion held in its per-client state).
  params = [digest(g.params) + digest(parts(g.extra).get('params', {}))
            for g in state.groups]
  return {'rounds': rounds, 'client_params': params, 'eval_head': m['eval_head'],
          'client_accuracy': m['client_accuracy']}
