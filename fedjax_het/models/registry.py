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
from fedjax_het.models.gefl_cnn import GEFL_DATASETS, GeFLCNN
from fedjax_het.models.googlenet import GoogLeNet
from fedjax_het.models.mobilenet import MobileNetV2
from fedjax_het.models.resnet import Bottleneck, ResNet
from fedjax_het.models.vit import VisionTransformer

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
  `conv` way ('xla', 'im2col' or 'auto'; same parameters, same function)."""
  if name not in _EXTRACTORS:
    raise ConfigError(f'ModelConfig.names: unknown model {name!r}; registered models are {", ".join(model_names())}.')
  return HeteroClassifier(_EXTRACTORS[name](conv_factory(conv)), num_classes, feature_dim, rm)


def assign_models(models: Sequence[str], num_clients: int) -> list[str]:
  """Client k's architecture is models[k % len(models)] (HtFLlib's model-family convention)."""
  if not models:
    raise ConfigError('ModelConfig.names is empty; give at least one model name, e.g. (\'cnn4\', \'resnet18\').')
  models = expand_models(models)
  for m in models:
    if m not in _EXTRACTORS:
      raise ConfigError(f'ModelConfig.names: unknown model {m!r}; registered models are {", ".join(model_names())}; '
                        f'families: {", ".join(MODEL_FAMILIES)}.')
  return [models[k % len(models)] for k in range(num_clients)]


register_model('cnn4', lambda conv: FedAvgCNN(conv=conv))
register_model('small_cnn', lambda conv: SmallCNN(conv=conv))
register_model('small_cnn_narrow', lambda conv: SmallCNN(channels=(16, 32), conv=conv))
register_model('mlp', lambda conv: MLP())
register_model('resnet4', lambda conv: ResNet((1,), conv=conv))
register_model('resnet6', lambda conv: ResNet((1, 1), conv=conv))
register_model('resnet8', lambda conv: ResNet((1, 1, 1), conv=conv))
register_model('resnet10', lambda conv: ResNet((1, 1, 1, 1), conv=conv))
register_model('resnet14', lambda conv: ResNet((1, 1, 2, 2), conv=conv))  # felo_velo.txt's family (InCo code)
register_model('resnet18', lambda conv: ResNet((2, 2, 2, 2), conv=conv))
register_model('resnet22', lambda conv: ResNet((2, 2, 3, 3), conv=conv))
register_model('resnet26', lambda conv: ResNet((3, 3, 3, 3), conv=conv))
register_model('resnet34', lambda conv: ResNet((3, 4, 6, 3), conv=conv))
register_model('resnet50', lambda conv: ResNet((3, 4, 6, 3), conv=conv, block=Bottleneck))
register_model('resnet101', lambda conv: ResNet((3, 4, 23, 3), conv=conv, block=Bottleneck))
register_model('resnet152', lambda conv: ResNet((3, 8, 36, 3), conv=conv, block=Bottleneck))
register_model('mobilenet_v2', lambda conv: MobileNetV2(conv=conv))
register_model('googlenet', lambda conv: GoogLeNet(conv=conv))
register_model('vit_b16', lambda conv: VisionTransformer(16, conv=conv))
register_model('vit_b32', lambda conv: VisionTransformer(32, conv=conv))
for _dataset in GEFL_DATASETS:
  for _k in range(1, 11):
    register_model(f'gefl_{_dataset}_cnn{_k}', lambda conv, d=_dataset, k=_k: GeFLCNN(d, k, conv=conv))

# HtFLlib's model families (its main.py, --model_family), and FedRE's 10-architecture set (fedre.txt Sec. 4.1).
MODEL_FAMILIES: dict[str, tuple[str, ...]] = {
    'HtFE-img-2': ('cnn4', 'resnet18'),
    'HtFE-img-3': ('resnet10', 'resnet18', 'resnet34'),
    'HtFE-img-4': ('cnn4', 'googlenet', 'mobilenet_v2', 'resnet18'),
    'HtFE-img-5': ('googlenet', 'mobilenet_v2', 'resnet18', 'resnet34', 'resnet50'),
    'HtFE-img-8': ('cnn4', 'googlenet', 'mobilenet_v2', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                   'resnet152'),
    'HtFE-img-9': ('resnet4', 'resnet6', 'resnet8', 'resnet10', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                   'resnet152'),
    'HtM-img-10': ('cnn4', 'googlenet', 'mobilenet_v2', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                   'resnet152', 'vit_b16', 'vit_b32'),
}
for _dataset in GEFL_DATASETS:  # GeFL's ten target networks (gefl.txt Tables XXI-XXIII)
  MODEL_FAMILIES[f'gefl-{_dataset}-10'] = tuple(f'gefl_{_dataset}_cnn{k}' for k in range(1, 11))
MODEL_FAMILIES['felo-5'] = ('resnet10', 'resnet14', 'resnet18', 'resnet22', 'resnet26')  # felo_velo.txt Table 2
MODEL_FAMILIES['felo-extreme-5'] = ('resnet10', 'resnet18', 'resnet26', 'resnet34', 'resnet50')  # Table 3
MODEL_FAMILIES['fedre-10'] = ('cnn4', 'mobilenet_v2', 'googlenet', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                              'resnet152', 'vit_b16', 'vit_b32')


def expand_models(models: Sequence[str]) -> tuple[str, ...]:
  """--models with family names (e.g. HtFE-img-8) replaced by their architectures, in order."""
  out: list[str] = []
  for m in models:
    out.extend(MODEL_FAMILIES.get(m, (m,)))
  return tuple(out)
