"""Model registry: architecture names -> `HeteroClassifier` constructors, and the model-family assignment.

Adding an architecture is one `register_model` call; its factory takes `conv`, the `nn.Conv`-compatible constructor
of the chosen convolution formulation (models/conv.py), and passes it to every convolution it builds. Client k gets architecture models[k % len(models)], as in
HtFLlib's model families.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import flax.linen as nn

from fedjax_het.errors import ConfigError
from fedjax_het.models.classifier import PRECISIONS, HeteroClassifier
from fedjax_het.models.cnn import MLP, FedAvgCNN, HeteroFLConv, SmallCNN
from fedjax_het.models.conv import ConvFactory, conv_factory
from fedjax_het.models.gefl_cnn import GEFL_DATASETS, GeFLCNN
from fedjax_het.models.googlenet import GoogLeNet
from fedjax_het.models.mobilenet import MobileNetV2
from fedjax_het.models.resnet import BasicBlock, Bottleneck, PreActBlock, ResNet
from fedjax_het.models.vit import VisionTransformer

ExtractorFactory = Callable[[ConvFactory], nn.Module]
_EXTRACTORS: dict[str, ExtractorFactory] = {}
_WIDTH_SCALED: dict[str, Callable[[ConvFactory, float], nn.Module]] = {}


def register_width_scaled(name: str, factory: Callable[[ConvFactory, float], nn.Module]) -> None:
  """Registers how architecture `name` narrows: factory(conv, rate) -> its extractor with every hidden width w
  replaced by ceil(rate * w) (HeteroFL's sub-models), built under the name 'NAME@RATE'."""
  _WIDTH_SCALED[name] = factory


def width_rate(name: str) -> tuple[str, float]:
  """('resnet18', 0.5) for 'resnet18@0.5'; (name, 1.0) for a name without a rate. A ConfigError for a rate that
  is not in (0, 1] or an architecture that does not narrow."""
  if '@' not in name:
    return name, 1.0
  base, _, rate = name.partition('@')
  try:
    value = float(rate)
  except ValueError:
    value = -1.0
  if not 0 < value <= 1:
    raise ConfigError(f'ModelConfig.names: {name!r}: the width rate after @ must be a number in (0, 1], e.g. '
                      f'{base}@0.5.')
  if base not in _WIDTH_SCALED:
    raise ConfigError(f'ModelConfig.names: {name!r}: {base!r} has no width-scaled form; these do: '
                      f'{", ".join(sorted(_WIDTH_SCALED))} (a model that flattens a feature map into a Dense, such as '
                      f'cnn4, has no channel-sliceable sub-model).')
  return base, value


def scaled(widths: Sequence[int], rate: float) -> tuple[int, ...]:
  """HeteroFL's widths of a sub-model: ceil(rate * w) each."""
  return tuple(int(math.ceil(rate * w - 1e-9)) for w in widths)


def register_model(name: str, extractor_factory: ExtractorFactory) -> None:
  """Registers an extractor constructor under `name` (it then composes with RM and head like every model)."""
  if name in _EXTRACTORS:
    raise ValueError(f'model {name!r} is already registered')
  _EXTRACTORS[name] = extractor_factory


def model_names() -> list[str]:
  """The registered architecture names, sorted."""
  return sorted(_EXTRACTORS)


def build_model(name: str, num_classes: int, feature_dim: int = 512, rm: str = 'ap', conv: str = 'xla',
                precision: str = 'float32', scan_blocks: bool = False) -> HeteroClassifier:
  """The classifier `name` with RM to `feature_dim`, a head to `num_classes`, convolutions computed the `conv` way
  ('xla', 'im2col', 'auto', ...; same parameters, same function) and `precision` the compute type of
  `models.forward` ('float32', or 'bfloat16' from float32 parameters); with `scan_blocks` an extractor that has
  runs of identical blocks (a `scan` field: ResNets, ViTs) scans them (models/repeat.py; same parameters, the
  numbers up to float32 rounding)."""
  if precision not in PRECISIONS:
    raise ConfigError(f'ModelConfig.precision={precision!r} is unknown; choose one of {", ".join(PRECISIONS)}.')
  base, rate = width_rate(name)
  if base not in _EXTRACTORS:
    raise ConfigError(unknown_model(name))
  extractor = (_WIDTH_SCALED[base](conv_factory(conv), rate) if '@' in name
               else _EXTRACTORS[name](conv_factory(conv)))
  if scan_blocks and 'scan' in {f.name for f in dataclasses.fields(extractor)}:
    extractor = extractor.clone(scan=True)
  return HeteroClassifier(extractor, num_classes, feature_dim, rm, precision)


def unknown_model(name: str) -> str:
  """The error of an unknown model name: the closest registered names and families, and where all are listed (there
  are over a hundred)."""
  from fedjax_het.errors import closest
  base = name.split('@', 1)[0]
  close = closest(base, model_names() + list(MODEL_FAMILIES))
  near = f'; the closest are {", ".join(close)}' if close else ''
  return (f'ModelConfig.names: unknown model {name!r}{near}. Fix: a registered model or family; '
          f'`python experiments/model_zoo.py` lists every model, docs/usage.md#models the families.')


def assign_models(models: Sequence[str], num_clients: int) -> list[str]:
  """Client k's architecture is models[k % len(models)] (HtFLlib's model-family convention)."""
  if not models:
    raise ConfigError('ModelConfig.names is empty; give at least one model name, e.g. (\'cnn4\', \'resnet18\').')
  models = expand_models(models)
  for m in models:
    if width_rate(m)[0] not in _EXTRACTORS:
      raise ConfigError(unknown_model(m))
  return [models[k % len(models)] for k in range(num_clients)]


register_model('cnn4', lambda conv: FedAvgCNN(conv=conv))
register_model('small_cnn', lambda conv: SmallCNN(conv=conv))
register_model('small_cnn_narrow', lambda conv: SmallCNN(channels=(16, 32), conv=conv))
register_model('mlp', lambda conv: MLP())
register_model('resnet4', lambda conv: ResNet((1,), conv=conv))
register_model('resnet6', lambda conv: ResNet((1, 1), conv=conv))
register_model('resnet8', lambda conv: ResNet((1, 1, 1), conv=conv))
register_model('resnet10', lambda conv: ResNet((1, 1, 1, 1), conv=conv))
register_model('resnet14', lambda conv: ResNet((1, 1, 2, 2), conv=conv))  # Felo/Velo's family (InCo code)
register_model('resnet18', lambda conv: ResNet((2, 2, 2, 2), conv=conv))
register_model('resnet22', lambda conv: ResNet((2, 2, 3, 3), conv=conv))
register_model('resnet26', lambda conv: ResNet((3, 3, 3, 3), conv=conv))
register_model('resnet34', lambda conv: ResNet((3, 4, 6, 3), conv=conv))
register_model('resnet50', lambda conv: ResNet((3, 4, 6, 3), conv=conv, block=Bottleneck))
register_model('resnet101', lambda conv: ResNet((3, 4, 23, 3), conv=conv, block=Bottleneck))
register_model('resnet152', lambda conv: ResNet((3, 8, 36, 3), conv=conv, block=Bottleneck))
# CIFAR-style ResNets (conv3x3/1 stem, no max-pool): the ResNet-18 of FedType's code, HeteroFL's pre-activation
# ResNet-18 (and at Felo's depth 26, as Felo runs HeteroFL), and the three-stage 16/32/64 ResNet-20 and ResNet-56 of the original paper's CIFAR-10 networks
register_model('resnet18_cifar', lambda conv: ResNet((2, 2, 2, 2), conv=conv, stem='cifar'))
register_model('preact_resnet18', lambda conv: ResNet((2, 2, 2, 2), conv=conv, block=PreActBlock, stem='cifar'))
register_model('preact_resnet26', lambda conv: ResNet((3, 3, 3, 3), conv=conv, block=PreActBlock, stem='cifar'))
register_model('resnet20_cifar', lambda conv: ResNet((3, 3, 3), base_width=16, conv=conv, stem='cifar'))
register_model('resnet56_cifar', lambda conv: ResNet((9, 9, 9), base_width=16, conv=conv, stem='cifar'))
# FedGKT's client "ResNet-8" (its resnet8_56): the 16-channel 3x3/1 stem, then two bottlenecks of 16 planes (64 out)
register_model('resnet8_gkt', lambda conv: ResNet((2,), base_width=16, conv=conv, block=Bottleneck, stem='cifar'))
register_model('mobilenet_v2', lambda conv: MobileNetV2(conv=conv))
register_model('googlenet', lambda conv: GoogLeNet(conv=conv))
register_model('vit_b16', lambda conv: VisionTransformer(16, conv=conv))
register_model('vit_b32', lambda conv: VisionTransformer(32, conv=conv))
register_model('heterofl_conv', lambda conv: HeteroFLConv(conv=conv))
register_width_scaled('heterofl_conv', lambda conv, rate: HeteroFLConv(scaled(HeteroFLConv.widths, rate), conv=conv))
_RESNETS = {'resnet4': ((1,), BasicBlock), 'resnet6': ((1, 1), BasicBlock), 'resnet8': ((1, 1, 1), BasicBlock),
            'resnet10': ((1, 1, 1, 1), BasicBlock), 'resnet14': ((1, 1, 2, 2), BasicBlock),
            'resnet18': ((2, 2, 2, 2), BasicBlock), 'resnet22': ((2, 2, 3, 3), BasicBlock),
            'resnet26': ((3, 3, 3, 3), BasicBlock), 'resnet34': ((3, 4, 6, 3), BasicBlock),
            'resnet50': ((3, 4, 6, 3), Bottleneck), 'resnet101': ((3, 4, 23, 3), Bottleneck),
            'resnet152': ((3, 8, 36, 3), Bottleneck)}
_RESNETS.update({'resnet18_cifar': ((2, 2, 2, 2), BasicBlock, 'cifar'),
                 'preact_resnet18': ((2, 2, 2, 2), PreActBlock, 'cifar'),
                 'preact_resnet26': ((3, 3, 3, 3), PreActBlock, 'cifar')})
for _name, (_stages, _block, *_stem) in _RESNETS.items():  # HeteroFL's widths: ceil(rate * (64, 128, 256, 512))
  register_width_scaled(_name, lambda conv, rate, st=_stages, b=_block, stem=(_stem or ['imagenet'])[0]: ResNet(
      st, conv=conv, block=b, stage_widths=scaled([64 * 2**i for i in range(len(st))], rate), stem=stem))
for _dataset in GEFL_DATASETS:
  for _k in range(1, 11):
    register_model(f'gefl_{_dataset}_cnn{_k}', lambda conv, d=_dataset, k=_k: GeFLCNN(d, k, conv=conv))

# HtFLlib's model families (its main.py, --model_family), and FedRE's 10-architecture set
# ("FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated Learning", Sec. 4.1).
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
for _dataset in GEFL_DATASETS:  # GeFL's ten target networks
  # ("GeFL: Model-Agnostic Federated Learning with Generative Models", Tables XXI-XXIII)
  MODEL_FAMILIES[f'gefl-{_dataset}-10'] = tuple(f'gefl_{_dataset}_cnn{k}' for k in range(1, 11))
# Felo/Velo's ResNets ("Exploiting Features and Logits in Heterogeneous Federated Learning", Tables 2 and 3).
MODEL_FAMILIES['felo-5'] = ('resnet10', 'resnet14', 'resnet18', 'resnet22', 'resnet26')  # Table 2
MODEL_FAMILIES['felo-extreme-5'] = ('resnet10', 'resnet18', 'resnet26', 'resnet34', 'resnet50')  # Table 3
MODEL_FAMILIES['fedre-10'] = ('cnn4', 'mobilenet_v2', 'googlenet', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                              'resnet152', 'vit_b16', 'vit_b32')


def expand_models(models: Sequence[str]) -> tuple[str, ...]:
  """--models with family names (e.g. HtFE-img-8) replaced by their architectures, in order."""
  out: list[str] = []
  for m in models:
    out.extend(MODEL_FAMILIES.get(m, (m,)))
  return tuple(out)
