"""Model registry: architecture names -> `HeteroClassifier` constructors, and the model-family assignment.

Adding an architecture is one `register_model` call; its factory takes `conv`, the `nn.Conv`-compatible constructor
of the chosen convolution formulation (models/conv.py), and passes it to every convolution it builds. Client k gets architecture models[k % len(models)], as in
HtFLlib's model families.
"""

from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn

from fedjax_het.errors import ConfigError
from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.cnn import MLP, FedAvgCNN, SmallCNN
from fedjax_het.models.conv import ConvFactory, conv_factory
from fedjax_het.models.resnet import ResNet

ExtractorFactory = Callable[[ConvFactory], nn.Module]
_EXTRACTORS: dict[str, ExtractorFactory] = {}


def register_model(name: str, extractor_factory: ExtractorFactory) -> None:
  """Registers an extractor constructor under `name` (it then composes with RM and head like every model)."""
  if name in _EXTRACTORS:
    raise ValueError(f'model {name!r} is already registered')
  _EXTRACTORS[name] = extractor_factory


def model_names() -> list[str]:
  """The registered architecture names, sorted."""
  return sorted(_EXTRACTORS)


def build_model(name: str, num_classes: int, feature_dim: int = 512, rm: str = 'ap', conv: str = 'xla'
                ) -> HeteroClassifier:
  """The classifier `name` with RM to `feature_dim`, a head to `num_classes`, and convolutions computed the
  `conv` way ('xla' or 'patches'; same parameters, same function)."""
  if name not in _EXTRACTORS:
    raise ConfigError(f'--models: unknown model {name!r}; registered models are {", ".join(model_names())}.')
  return HeteroClassifier(_EXTRACTORS[name](conv_factory(conv)), num_classes, feature_dim, rm)


def assign_models(models: Sequence[str], num_clients: int) -> list[str]:
  """Client k's architecture is models[k % len(models)] (HtFLlib's model-family convention)."""
  if not models:
    raise ConfigError('--models is empty; give at least one model name, e.g. --models=cnn4,resnet18.')
  for m in models:
    if m not in _EXTRACTORS:
      raise ConfigError(f'--models: unknown model {m!r}; registered models are {", ".join(model_names())}.')
  return [models[k % len(models)] for k in range(num_clients)]


register_model('cnn4', lambda conv: FedAvgCNN(conv=conv))
register_model('small_cnn', lambda conv: SmallCNN(conv=conv))
register_model('small_cnn_narrow', lambda conv: SmallCNN(channels=(16, 32), conv=conv))
register_model('mlp', lambda conv: MLP())
register_model('resnet10', lambda conv: ResNet((1, 1, 1, 1), conv=conv))
register_model('resnet18', lambda conv: ResNet((2, 2, 2, 2), conv=conv))
register_model('resnet34', lambda conv: ResNet((3, 4, 6, 3), conv=conv))
