"""The method registry: every method's name, hyperparameter dataclass and factory, in one place.

Adding a method is its module plus one line in `METHODS`. A method's hyperparameters are the fields of its frozen
config dataclass; each field names its command-line flag in its metadata (`hyperparameter`), so the flags of
experiments/ are derived from the dataclasses (fedjax_het.run.cli) and grouped per method in --helpfull. Methods may
share a flag (e.g. --lamda) when the field means the same thing in each. A factory returns the method's
`Algorithm`; it takes `cfg` (the method's config; not passed to methods without hyperparameters) and, by keyword,
the fields of the `Run` it is built for that its entry names in `Method.reads` (default: num_classes), so a factory
keeps the signature a notebook calls it with and registers without an adapter. The local schedule (learning rate,
batch size, epochs) reaches programs and server steps as `GroupSpec.training` / `FederationSpec.training`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np

from fedjax_het.core import Algorithm
from fedjax_het.data.federated import PublicData
from fedjax_het.errors import ConfigError
from fedjax_het.methods import (AvgKDConfig, CCVRConfig, FDConfig, FedALAConfig, FedDFConfig, FedGenConfig, FedGHConfig,
                                FedGKTConfig, FedHeConfig, FedKDConfig, FedMDConfig, FedMRLConfig, FedProtoConfig,
                                FedProxConfig, FedREConfig, FedTGPConfig, FedTypeConfig, FedVTCConfig, FeloConfig,
                                FMLConfig, FPLConfig, GeFLConfig, GeFLFConfig, HeteroFLConfig, PFedAFMConfig,
                                VeloConfig, avgkd, ccvr, fd, fedala, fedavg_grouped, feddf, fedgen, fedgh, fedgkt,
                                fedhe, fedkd, fedmd, fedmrl, fedprox, fedproto, fedre, fedtgp, fedtype, fedvtc, felo,
                                fml, fpl, gefl, gefl_f, heterofl, lg_fedavg, lg_fedavg_first_block, local, pfedafm,
                                velo)


@dataclasses.dataclass(frozen=True)
class NoHyperparameters:
  """The config of methods without hyperparameters of their own."""


@dataclasses.dataclass(frozen=True)
class Run:
  """What a method's factory may read of the run it is built for.

  `rounds` (--rounds) is read through a property that records the read: a method that reads it (a schedule over
  the run's length, like FedKD's energy threshold) gives numbers that depend on --rounds, so `depends_on_rounds`
  tells the experiment that --rounds cannot change when such a run is resumed. `label_counts` is computed only
  when a factory asks for it.
  """
  num_classes: int
  num_clients: int
  total_rounds: int
  feature_dim: int
  loader_label_counts: Callable[[], np.ndarray]  # all clients' training labels as their train loaders yield them
  public_data: Optional[PublicData] = None  # the server's public dataset (`FederatedData.public`)
  _reads: set = dataclasses.field(default_factory=set, compare=False, repr=False)

  @property
  def rounds(self) -> int:
    """--rounds, the run's length."""
    self._reads.add('rounds')
    return self.total_rounds

  @property
  def label_counts(self) -> np.ndarray:
    """[C] all clients' training label counts as their train loaders yield them."""
    return self.loader_label_counts()

  @property
  def public(self) -> PublicData:
    """The server's public dataset; a ConfigError naming the flags when the run has none."""
    if self.public_data is None:
      raise ConfigError('This method distils on the server\'s public dataset, and the run has none. Fix: '
                        '--public_size=N (N training rows held out of every client\'s data) or '
                        '--public_dataset=NAME (another dataset).')
    return self.public_data

  @property
  def depends_on_rounds(self) -> bool:
    """Whether the factory read `rounds`."""
    return 'rounds' in self._reads


RUN_FIELDS = ('num_classes', 'num_clients', 'rounds', 'feature_dim', 'label_counts', 'public')


@dataclasses.dataclass(frozen=True)
class Method:
  """A registered method: its hyperparameter dataclass, its factory, a one-line summary, and the fields of `Run`
  the factory takes by keyword (`reads`, see the module docstring)."""
  config: type
  factory: Callable[..., Algorithm]
  summary: str
  reads: tuple[str, ...] = ('num_classes',)

  def __post_init__(self):
    unknown = [name for name in self.reads if name not in RUN_FIELDS]
    if unknown:
      raise TypeError(f'{self.factory.__name__}: reads {unknown}, which are not fields of Run '
                      f'({", ".join(RUN_FIELDS)}).')

  def algorithm(self, cfg: Any, run: Run) -> Algorithm:
    """The factory's `Algorithm` for `cfg` and `run`."""
    arguments = {name: getattr(run, name) for name in self.reads}
    return self.factory(**arguments) if self.config is NoHyperparameters else self.factory(cfg, **arguments)


METHODS: dict[str, Method] = {
    'fedre': Method(FedREConfig, fedre,
                    'FedRE: one entangled representation and soft label per client, a global head'),
    'local': Method(NoHyperparameters, local, 'Local training, no communication'),
    'fedavg': Method(NoHyperparameters, fedavg_grouped, 'FedAvg within each architecture group'),
    'lg_fedavg': Method(NoHyperparameters, lg_fedavg, 'LG-FedAvg: local extractors, an averaged head'),
    'fedproto': Method(FedProtoConfig, fedproto, 'FedProto: class prototypes'),
    'fedgh': Method(FedGHConfig, fedgh, 'FedGH: a global head trained on prototypes'),
    'fedtgp': Method(FedTGPConfig, fedtgp, 'FedTGP: trainable global prototypes with an adaptive margin'),
    'fd': Method(FDConfig, fd, 'FD: per-class mean logits'),
    'fedgen': Method(FedGenConfig, fedgen, 'FedGen: a server generator in representation space',
                     reads=('num_classes', 'label_counts')),
    'fml': Method(FMLConfig, fml, 'FML: mutual learning with a shared model'),
    'fedkd': Method(FedKDConfig, fedkd, 'FedKD: distillation with an SVD-compressed shared mentee',
                    reads=('num_classes', 'rounds')),
    'fedmrl': Method(FedMRLConfig, fedmrl, 'FedMRL: a shared model fused with the local one (Matryoshka)',
                     reads=('num_classes', 'feature_dim')),
    'fpl': Method(FPLConfig, fpl, 'FPL: clustered prototypes',
                  reads=('num_classes', 'num_clients')),
    'ccvr': Method(CCVRConfig, ccvr, 'CCVR: heads calibrated on virtual representations'),
    'pfedafm': Method(PFedAFMConfig, pfedafm, 'pFedAFM: the client\'s features mixed entry by entry with a shared '
                                              'small extractor\'s by learned weights',
                      reads=()),
    'fedtype': Method(FedTypeConfig, fedtype, 'FedType: a shared proxy model distilled from each private model, '
                                              'which learns back through conformal prediction sets'),
    'fedvtc': Method(FedVTCConfig, fedvtc,
                     'FedVTC: prototypes and SDs, a VTC decoder per client, fine-tuning on its samples',
                     reads=('num_classes', 'rounds')),
    'fedprox': Method(FedProxConfig, fedprox, 'FedProx within each architecture group'),
    'gefl': Method(GeFLConfig, gefl,
                   'GeFL: a federated conditional generator (DCGAN, CVAE, DDPM) aiding heterogeneous targets',
                   reads=('num_classes', 'rounds')),
    'gefl_f': Method(GeFLFConfig, gefl_f, 'GeFL-F: GeFL on the features of a shared extractor',
                     reads=('num_classes', 'rounds')),
    'lg_fedavg_fb': Method(NoHyperparameters, lg_fedavg_first_block,
                           "LG-FedAvg as GeFL runs it: GeFL CNNs' first block shared, the rest within groups"),
    'felo': Method(FeloConfig, felo, 'Felo: per-class mid-level features and logits, FedAvg within groups',
                   reads=('num_classes', 'rounds', 'num_clients')),
    'velo': Method(VeloConfig, velo, 'Velo: Felo with class features generated by a server CVAE',
                   reads=('num_classes', 'rounds', 'num_clients')),
    'fedhe': Method(FedHeConfig, fedhe, 'FedHe: per-class logits only (Felo without the feature term)',
                    reads=('num_classes', 'rounds', 'num_clients')),
    'fedmd': Method(FedMDConfig, fedmd, 'FedMD: transfer learning, then digesting the consensus of logits on '
                                        'public data',
                    reads=('num_classes', 'public')),
    'feddf': Method(FedDFConfig, feddf, 'FedDF: ensemble distillation into each architecture\'s model on public data '
                                        'at the server',
                    reads=('num_classes', 'public')),
    'avgkd': Method(AvgKDConfig, avgkd, 'AvgKD: soft targets from the other architectures\' models'),
    'fedala': Method(FedALAConfig, fedala, 'FedALA within each architecture group: adaptive local aggregation'),
    'fedgkt': Method(FedGKTConfig, fedgkt, 'FedGKT: small client models, a large server model trained on their '
                                           'features, distillation both ways'),
    'heterofl': Method(HeteroFLConfig, heterofl, 'HeteroFL: width-scaled sub-models of one global model, averaged '
                                                 'entry by entry'),
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


def config_flags(name: str) -> dict[str, str]:
  """field -> command-line flag (without '--') of registered method `name`'s hyperparameters."""
  return {field.name: flag_name(field) for field in dataclasses.fields(method(name).config)}


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
  kwargs = {field: values[flag] for field, flag in config_flags(name).items() if flag in values}
  base = base if base is not None else m.config()
  return dataclasses.replace(base, **kwargs)
