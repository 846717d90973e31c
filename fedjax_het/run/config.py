"""The experiment configuration: one frozen dataclass, filled from absl flags or built directly in a notebook."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import Optional

import jax
from absl import logging

from fedjax_het.data.datasets import black_pixel
from fedjax_het.errors import ConfigError, naming_flags
from fedjax_het.local_training import LocalTraining


# The command-line flag of each library argument a ConfigError may name (`errors.naming_flags`).
FLAGS_OF_ARGUMENTS = {
    'LocalTraining.learning_rate': '--local_learning_rate', 'LocalTraining.batch_size': '--batch_size',
    'LocalTraining.epochs': '--local_epochs', 'LocalTraining.order': '--data_order',
    'LocalTraining.max_steps': '--local_steps', 'LocalTraining.augment': '--augment', 'LocalTraining.drop_last=True': '--drop_last',
    'LocalTraining.drop_last=False': '--nodrop_last', 'LocalTraining.drop_last': '--drop_last',
    'ModelConfig.names': '--models', 'ModelConfig.precision': '--precision', 'ModelConfig.*': '', 'Dataset.resized(32)': '--image_size=32',
    'Federation.*': '', 'make_federated_data.num_clients': '--num_clients', 'make_federated_data.*': '',
    'ExecutionConfig.client_mesh=None': '--num_devices=1', 'ExecutionConfig.client_mesh=': '--num_devices=',
    'client_mesh.num_devices': '--num_devices',
    "ExecutionConfig.strategy='vmap'": '--strategy=vmap', 'ExecutionConfig.*': '',
    'Dataset.matching': '--public_dataset',
    'DPConfig.mode': '--dp_mode', 'DPConfig.clip_parts': '--dp_clip_parts', 'DPConfig.clip': '--dp_clip',
    'DPConfig.noise_multiplier': '--dp_noise_multiplier', 'DPConfig.parts': '--dp_parts',
    'PrivacyBudget.accountant': '--dp_accountant', 'PrivacyBudget.delta': '--dp_delta',
    'PrivacyBudget.allow_large_delta=True': '--dp_allow_large_delta',
}


def flags_of_arguments() -> dict[str, str]:
  """`FLAGS_OF_ARGUMENTS` and, for every registered method, each field of its config ('FMLConfig.alpha') with
  its command-line flag ('--fml_alpha')."""
  from fedjax_het.run.registry import METHODS, config_flags
  own = {f'{m.config.__name__}.{field}': f'--{flag}' for name, m in METHODS.items()
         for field, flag in config_flags(name).items()}
  return {**own, **FLAGS_OF_ARGUMENTS}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """Everything that defines a run. Defaults follow FedRE's CIFAR setting
  ("FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated Learning", Table 10)
  and HtFLlib's reference protocol."""
  algorithm: str = 'fedre'
  dataset: str = 'cifar10'
  data_dir: Optional[str] = None
  image_size: int = 0  # 0: as loaded; S: every image resized to S x S (GeFL resizes MNIST 28 -> 32)
  input_normalization: str = 'symmetric'  # (x/255 - 0.5) / 0.5; 'cifar10': CIFAR-10's per-channel mean and std
  data_fraction: float = 1.0  # share of the training set used, a seeded subsample (GeFL Table XIV: 0.1 / 0.5)
  partition: str = 'dirichlet'
  alpha: float = 0.1
  classes_per_client: int = 2
  balance: bool = False
  imbalance_factor: float = 1.0
  # The server's public dataset of FedMD and FedDF: public_size rows held out of the training rows before they
  # are partitioned, or (public_dataset set) rows of another dataset, matched to the clients' image shape.
  public_size: int = 0
  public_dataset: str = ''
  server_validation_size: int = 0  # labelled training rows held out for the server's validation (FedDF's code)
  eval_protocol: str = 'pooled'
  train_fraction: Optional[float] = None
  num_clients: int = 10
  join_ratio: float = 1.0
  full_participation_rounds: int = 0  # the run's last N rounds train every client (FedVTC's baselines: 5)
  participation: str = 'fixed'  # 'fixed': join_ratio of the clients a round; 'poisson': each with that probability
  models: tuple[str, ...] = ('cnn4',)
  feature_dim: int = 512
  rm: str = 'ap'
  rounds: int = 100
  local_epochs: int = 1
  local_steps: int = 0  # at most this many local steps per round (0: every step of local_epochs epochs)
  batch_size: int = 32
  local_learning_rate: float = 0.06
  data_order: str = 'stored'  # HtFLlib's DataLoader(shuffle=False, drop_last=True); 'shuffle': PFLlib
  drop_last: bool = True  # HtFLlib's loader drops the last partial batch; False: PyTorch's default (GeFL's code)
  augment: str = 'none'  # 'crop_flip': random crop (padding 4) and flip of every local batch; + '_cutout'
  init: str = 'torch'  # PyTorch's default Conv/Linear initialisation (HtFLlib); 'flax': Flax's defaults
  shared_init: bool = True  # clients of one architecture start identical (HtFLlib seeds 0 before each model)
  precision: str = 'float32'  # 'bfloat16': the classifiers compute in bfloat16 from float32 parameters
  # Every registered method's hyperparameters by name (its config dataclass, `fedjax_het.run.registry`); methods left
  # out take their defaults, e.g. methods={'fedproto': FedProtoConfig(lamda=5.0)}.
  methods: dict = dataclasses.field(default_factory=dict)
  seed: int = 0
  strategy: Optional[str] = None
  chunk_size: int = 0
  conv: Optional[str] = None
  scan_unroll: int = 1
  num_devices: int = 0
  client_threads: Optional[int] = None
  onednn_threads: Optional[int] = None
  group_threads: Optional[int] = None  # groups initialised and compiled at once (None: the cores)
  eval_every: int = 1
  eval_batch_size: int = 0  # 0: the backend default (engine.default_eval_batch_size)
  memory_budget_gib: float = 0.0  # device memory a vmapped call may use (0: a share of the device's memory)
  stream_clients: bool = False  # vmap: client states and rows on the host, streamed to the device chunk by chunk
  checkpoint_every: int = 10
  # Client-level differential privacy of the uploads (`fedjax_het.privacy.dp`, docs/privacy.md); off by default.
  dp_mode: str = 'off'  # 'central' (a trusted server noises each sum) or 'local' (each client noises its upload)
  dp_clip: float = 1.0  # C, the L2 bound of a client's contribution
  dp_noise_multiplier: float = 0.0  # sigma: noise N(0, sigma^2 C^2); or set dp_target_epsilon
  dp_target_epsilon: float = 0.0  # > 0: sigma calibrated so that the whole run spends this epsilon at dp_delta
  dp_delta: float = 1e-5
  dp_clip_parts: str = 'whole'  # 'each': each private part of the upload to C / sqrt(parts)
  dp_parts: tuple[str, ...] = ()  # public upload parts privatised too (every other part is private)
  dp_accountant: str = 'rdp'  # 'rdp' or 'pld' (dp-accounting)
  dp_allow_large_delta: bool = False  # report epsilon at a delta >= 1 / clients anyway
  dp_reproducible_noise: bool = False  # DP noise (and draw) from --seed: reproducible research, no guarantee

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
    if not 0 < self.data_fraction <= 1 or self.image_size < 0:
      raise ConfigError(f'--data_fraction={self.data_fraction} must be in (0, 1] and --image_size={self.image_size} '
                        f'>= 0 (0 keeps the dataset\'s size).')
    self.dp_config()  # its own checks, naming the flags
    if self.dp_mode == 'off' and (self.dp_noise_multiplier > 0 or self.dp_target_epsilon > 0 or self.dp_parts):
      raise ConfigError('--dp_noise_multiplier, --dp_target_epsilon and --dp_parts act only under DP, and '
                        '--dp_mode=off. Fix: --dp_mode=central or --dp_mode=local (docs/privacy.md), or drop them.')
    if self.dp_mode != 'off' and (self.dp_noise_multiplier > 0) == (self.dp_target_epsilon > 0):
      raise ConfigError(f'--dp_mode={self.dp_mode} needs the noise: exactly one of --dp_noise_multiplier (now '
                        f'{self.dp_noise_multiplier}) and --dp_target_epsilon (now {self.dp_target_epsilon}) > 0.')
    if not (math.isfinite(self.dp_target_epsilon) and self.dp_target_epsilon >= 0):
      raise ConfigError(f'--dp_target_epsilon={self.dp_target_epsilon} must be a number >= 0 (0: use '
                        f'--dp_noise_multiplier).')
    from fedjax_het.run.registry import config_flags
    for field, flag in config_flags(self.algorithm).items():
      value = getattr(self.method_config, field)
      if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f'--{flag}={value} ({self.algorithm}) must be a finite number.')

  @property
  def method_config(self):
    """The hyperparameters of --algorithm."""
    return self.methods[self.algorithm]

  def local_training(self) -> LocalTraining:
    """The local SGD settings of this config."""
    with flags_named():
      return LocalTraining(self.local_learning_rate, self.batch_size, self.local_epochs, self.data_order,
                           max_steps=self.local_steps if self.local_steps != 0 else None, drop_last=self.drop_last,
                           augment=self.augment, augment_fill=black_pixel(self.input_normalization))

  def dp_config(self, noise_multiplier: Optional[float] = None, fixed_denominator: bool = False):
    """The DP layer's settings (`privacy.dp.DPConfig`), with `noise_multiplier` (a calibrated sigma) in place of
    --dp_noise_multiplier when given; fixed_denominator: means divided by the expected count (an amplified run
    under Poisson sampling)."""
    from fedjax_het.privacy.dp import DPConfig
    with flags_named():
      return DPConfig(self.dp_mode, self.dp_clip, self.dp_noise_multiplier if noise_multiplier is None
                      else noise_multiplier, self.dp_clip_parts, self.dp_parts, fixed_denominator)

  def model_config(self):
    """The clients' classifiers of this config (`engine.ModelConfig`)."""
    from fedjax_het.engine.groups import ModelConfig
    with flags_named():
      return ModelConfig(tuple(self.models), self.feature_dim, self.rm, self.init, self.shared_init, self.precision)

  def execution_config(self):
    """How this config's rounds run (`engine.ExecutionConfig`), with --num_devices as a client mesh; its errors
    name the flags."""
    from fedjax_het.engine.execution import ExecutionConfig
    from fedjax_het.engine.sharding import client_mesh
    with flags_named():
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
                                  self.memory_budget_bytes, self.stream_clients, self.group_threads)
      resolved = execution.resolve()  # e.g. --conv=onednn where it cannot run: refused now, before any data is read
      if self.onednn_threads is not None and resolved.conv != 'onednn':
        logging.warning('--onednn_threads=%d is ignored: it sets the threads of oneDNN\'s convolutions, and this '
                        'run computes them with --conv=%s.', self.onednn_threads, resolved.conv)
      return execution

  @property
  def memory_budget_bytes(self) -> Optional[int]:
    """--memory_budget_gib in bytes (None: the backend's default)."""
    return int(self.memory_budget_gib * 2**30) if self.memory_budget_gib else None

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
