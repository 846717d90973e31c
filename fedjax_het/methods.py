"""The method registry: every method's name, hyperparameter dataclass and factory, in one place.

Adding a method is its module plus one line in `METHODS`. A method's hyperparameters are the fields of its
frozen config dataclass; each field names its command-line flag in its metadata (`hyperparameter`), so the flags
of experiments/ are derived from the dataclasses (fedjax_het.cli) and grouped per method in --helpfull. Methods
may share a flag (e.g. --lamda) when the field means the same thing in each. Every factory has one signature:
(its config, the `Run` it is built for) -> `Algorithm`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from fedjax_het.algorithms import (CCVRConfig, FDConfig, FedGenConfig, FedGHConfig, FedKDConfig, FedMRLConfig,
                                   FedProtoConfig, FedProxConfig, FedREConfig, FedTGPConfig, FedVTCConfig, FedHeConfig, FeloConfig,
                                   FMLConfig, FPLConfig, GeFLConfig, GeFLFConfig, VeloConfig, ccvr, fd, fedavg_grouped,
                                   fedgen, fedgh, fedhe, fedkd, fedmrl, fedprox, fedproto, fedre, fedtgp, fedvtc, felo,
                                   fml, fpl, gefl, gefl_f, lg_fedavg, lg_fedavg_first_block, local, velo)
from fedjax_het.core import Algorithm
from fedjax_het.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class NoHyperparameters:
  """The config of methods without hyperparameters of their own."""


@dataclasses.dataclass(frozen=True)
class Run:
  """What a method's factory may read of the run it is built for.

  `rounds` (--rounds) is read through a property that records the read: a method that reads it (a schedule over
  the run's length, like FedKD's energy threshold) gives numbers that depend on --rounds, so `depends_on_rounds`
  tells the experiment that --rounds cannot change when such a run is resumed.
  """
  num_classes: int
  num_clients: int
  total_rounds: int
  feature_dim: int
  batch_size: int
  local_learning_rate: float
  label_counts: Callable[[], np.ndarray]  # all clients' training labels as their train loaders yield them
  _reads: set = dataclasses.field(default_factory=set, compare=False, repr=False)

  @property
  def rounds(self) -> int:
    """--rounds, the run's length."""
    self._reads.add('rounds')
    return self.total_rounds

  @property
  def depends_on_rounds(self) -> bool:
    """Whether the factory read `rounds`."""
    return 'rounds' in self._reads


@dataclasses.dataclass(frozen=True)
class Method:
  """A registered method: its hyperparameter dataclass, its factory and a one-line summary."""
  config: type
  build: Callable[[Any, Run], Algorithm]
  summary: str


METHODS: dict[str, Method] = {
    'fedre': Method(FedREConfig, lambda c, run: fedre(c, run.num_classes),
                    'FedRE: one entangled representation and soft label per client, a global head'),
    'local': Method(NoHyperparameters, lambda c, run: local(run.num_classes), 'Local training, no communication'),
    'fedavg': Method(NoHyperparameters, lambda c, run: fedavg_grouped(run.num_classes),
                     'FedAvg within each architecture group'),
    'lg_fedavg': Method(NoHyperparameters, lambda c, run: lg_fedavg(run.num_classes),
                        'LG-FedAvg: local extractors, an averaged head'),
    'fedproto': Method(FedProtoConfig, lambda c, run: fedproto(c, run.num_classes), 'FedProto: class prototypes'),
    'fedgh': Method(FedGHConfig, lambda c, run: fedgh(c, run.num_classes, run.batch_size),
                    'FedGH: a global head trained on prototypes'),
    'fedtgp': Method(FedTGPConfig, lambda c, run: fedtgp(c, run.num_classes, run.batch_size,
                                                         run.local_learning_rate),
                     'FedTGP: trainable global prototypes with an adaptive margin'),
    'fd': Method(FDConfig, lambda c, run: fd(c, run.num_classes), 'FD: per-class mean logits'),
    'fedgen': Method(FedGenConfig, lambda c, run: fedgen(c, run.num_classes, run.batch_size, run.label_counts()),
                     'FedGen: a server generator in representation space'),
    'fml': Method(FMLConfig, lambda c, run: fml(c, run.num_classes), 'FML: mutual learning with a shared model'),
    'fedkd': Method(FedKDConfig, lambda c, run: fedkd(c, run.num_classes, run.rounds),
                    'FedKD: distillation with an SVD-compressed shared mentee'),
    'fedmrl': Method(FedMRLConfig, lambda c, run: fedmrl(c, run.num_classes, run.feature_dim),
                     'FedMRL: a shared model fused with the local one (Matryoshka)'),
    'fpl': Method(FPLConfig, lambda c, run: fpl(c, run.num_classes, run.num_clients),
                  'FPL: clustered prototypes'),
    'ccvr': Method(CCVRConfig, lambda c, run: ccvr(c, run.num_classes, run.batch_size),
                   'CCVR: heads calibrated on virtual representations'),
    'fedvtc': Method(FedVTCConfig, lambda c, run: fedvtc(c, run.num_classes, run.rounds),
                     'FedVTC: prototypes and SDs, a VTC decoder per client, fine-tuning on its samples'),
    'fedprox': Method(FedProxConfig, lambda c, run: fedprox(c, run.num_classes),
                      'FedProx within each architecture group'),
    'gefl': Method(GeFLConfig, lambda c, run: gefl(c, run.num_classes, run.rounds),
                   'GeFL: a federated conditional generator (DCGAN, CVAE, DDPM) aiding heterogeneous targets'),
    'gefl_f': Method(GeFLFConfig, lambda c, run: gefl_f(c, run.num_classes, run.rounds),
                     'GeFL-F: GeFL on the features of a shared extractor'),
    'lg_fedavg_fb': Method(NoHyperparameters, lambda c, run: lg_fedavg_first_block(run.num_classes),
                           "LG-FedAvg as GeFL runs it: GeFL CNNs' first block shared, the rest within groups"),
    'felo': Method(FeloConfig, lambda c, run: felo(c, run.num_classes, run.rounds, run.num_clients),
                   'Felo: per-class mid-level features and logits, FedAvg within groups'),
    'velo': Method(VeloConfig, lambda c, run: velo(c, run.num_classes, run.rounds, run.num_clients),
                   'Velo: Felo with class features generated by a server CVAE'),
    'fedhe': Method(FedHeConfig, lambda c, run: fedhe(c, run.num_classes, run.rounds, run.num_clients),
                    'FedHe: per-class logits only (Felo without the feature term)'),
}


def method(name: str) -> Method:
  """The registered method `name`, or a ConfigError listing them."""
  if name not in METHODS:
    raise ConfigError(f'--algorithm={name!r} is unknown; choose one of {", ".join(METHODS)}.')
  return METHODS[name]


def default_configs() -> dict:
  """Every registered method's default hyperparameters, by name."""
  return {name: m.config() for name, m in METHODS.items()}


def flag_name(field: dataclasses.Field) -> str:
  """The command-line flag of a hyperparameter field (its metadata's 'flag', else its name)."""
  return field.metadata.get('flag', field.name)


def hyperparameter_flags() -> dict[str, list[tuple[str, dataclasses.Field]]]:
  """flag -> the (method, field) pairs it sets, over every registered method."""
  out: dict = {}
  for name, m in METHODS.items():
    for field in dataclasses.fields(m.config):
      out.setdefault(flag_name(field), []).append((name, field))
  return out


def config_with(name: str, values: dict[str, Any], base: Optional[Any] = None) -> Any:
  """Method `name`'s config with the hyperparameters whose flags appear in `values` (flag -> value) replaced."""
  m = method(name)
  kwargs = {f.name: values[flag_name(f)] for f in dataclasses.fields(m.config) if flag_name(f) in values}
  base = base if base is not None else m.config()
  return dataclasses.replace(base, **kwargs)
