"""The FedRE round as HtFLlib runs it, in PyTorch: the reference that benchmarks/vs_pytorch.py times against.

What a round does here, following HtFLlib's client/server loop (not its code):
  for each participating client, one after another in Python:
    [disk] load the client's model object from disk (HtFLlib's `load_item`)
    set its head to the global head (Alg. 1, line 6, of "FedRE: A Representation Entanglement Framework for
      Model-Heterogeneous Federated Learning", as fedjax_het does)
    build a shuffled DataLoader over its training rows (drop_last) and a fresh torch.optim.SGD
    run `epochs` epochs of CE steps
    eval-mode pass over its training rows -> representations; RAP weights -> one entangled (r~, y~)
    [disk] save the model object (HtFLlib's `save_item`)
  server: SGD on the global head over the uploaded rows (batch 10, summed soft-label CE), 1 epoch.

The model is HtFLlib's FedAvgCNN ("4-layer CNN"): conv32k5-pool-conv64k5-pool-fc512 -> head. RM with d = 512 on a
512-wide vector is the identity, as in fedjax_het's `cnn4`. `load_flax_params` copies a fedjax_het `cnn4`
initialisation into it, so both sides can start from the same weights (tests/test_torch_reference.py).

The seed papers' other client models (FedRE's ten architectures, GeFL's CIFAR-10 CNNs; benchmarks/paper_settings.py
times them) are written below in torchvision's layouts (not copied from torchvision or HtFLlib), each as the
library's classifier is: extractor -> RM (mean over positions, then adaptive average pooling of the channels to d)
-> head. `torch_model(name)` builds one, `load_flax_classifier` copies a fedjax_het initialisation into it (its
parameters and BatchNorm statistics), and tests/test_torch_reference.py checks the parameter counts and one SGD
step's losses against fedjax_het's models.

Optional dependency: `pip install -e '.[torch]'` (CPU or CUDA build from PyPI).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class TorchCNN4(nn.Module):
  """HtFLlib's FedAvgCNN(in_features=3, num_classes, dim=1600) split into extractor and head."""

  def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 512, flat: int = 1600):
    super().__init__()
    self.conv1 = nn.Conv2d(in_channels, 32, 5)
    self.conv2 = nn.Conv2d(32, 64, 5)
    self.fc1 = nn.Linear(flat, width)
    self.head = nn.Linear(width, num_classes)

  def represent(self, x: torch.Tensor) -> torch.Tensor:
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    return F.relu(self.fc1(torch.flatten(x, 1)))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.head(self.represent(x))


def load_flax_params(model: TorchCNN4, params: dict) -> TorchCNN4:
  """Copies fedjax_het `cnn4` parameters (one client, NHWC/HWIO layout) into the PyTorch model (NCHW/OIHW)."""
  ext = params['extractor']
  t = lambda a: torch.from_numpy(np.array(a, np.float32))
  with torch.no_grad():
    for name, conv in (('Conv_0', model.conv1), ('Conv_1', model.conv2)):
      conv.weight.copy_(t(np.transpose(ext[name]['kernel'], (3, 2, 0, 1))))
      conv.bias.copy_(t(ext[name]['bias']))
    # Flax flattens (h, w, c); torch flattens (c, h, w).
    k = np.asarray(ext['Dense_0']['kernel'])
    channels = model.conv2.out_channels
    side = int(round((k.shape[0] // channels) ** 0.5))
    k = k.reshape(side, side, channels, -1).transpose(2, 0, 1, 3).reshape(k.shape[0], -1)
    model.fc1.weight.copy_(t(k.T))
    model.fc1.bias.copy_(t(ext['Dense_0']['bias']))
    model.head.weight.copy_(t(np.asarray(params['head']['kernel']).T))
    model.head.bias.copy_(t(params['head']['bias']))
  return model


# ---------------------------------------------------------------- the seed papers' other architectures
# Each extractor returns what fedjax_het's returns: a feature map [B, C, H, W] or a vector [B, L]; `TorchClassifier`
# adds RM and the head. Layouts follow torchvision's (HtFLlib builds its models from torchvision); the layer
# widths are those of fedjax_het/models/ (resnet.py, mobilenet.py, googlenet.py, vit.py, gefl_cnn.py).


class TorchClassifier(nn.Module):
  """extractor -> RM to `feature_dim` (a map averaged over positions, then F.adaptive_avg_pool1d over the channels
  when their count differs: fedjax_het's rm='ap') -> head Linear(feature_dim, num_classes)."""

  def __init__(self, extractor: nn.Module, num_classes: int = 10, feature_dim: int = 512):
    super().__init__()
    self.extractor, self.feature_dim = extractor, feature_dim
    self.head = nn.Linear(feature_dim, num_classes)

  def represent(self, x: torch.Tensor) -> torch.Tensor:
    h = self.extractor(x)
    if h.dim() > 2:
      h = h.mean(dim=tuple(range(2, h.dim())))
    if h.shape[1] != self.feature_dim:
      h = F.adaptive_avg_pool1d(h.unsqueeze(1), self.feature_dim).squeeze(1)
    return h

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.head(self.represent(x))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, eps: float = 1e-5) -> nn.Sequential:
  return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                       nn.BatchNorm2d(cout, eps=eps))


class TorchBasicBlock(nn.Module):
  expansion = 1

  def __init__(self, cin: int, planes: int, stride: int = 1):
    super().__init__()
    self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(planes)
    self.downsample = _conv_bn(cin, planes, 1, stride) if stride != 1 or cin != planes else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
    return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class TorchBottleneck(nn.Module):
  expansion = 4

  def __init__(self, cin: int, planes: int, stride: int = 1):
    super().__init__()
    self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(planes)
    self.conv3 = nn.Conv2d(planes, 4 * planes, 1, bias=False)
    self.bn3 = nn.BatchNorm2d(4 * planes)
    self.downsample = _conv_bn(cin, 4 * planes, 1, stride) if stride != 1 or cin != 4 * planes else None

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = F.relu(self.bn1(self.conv1(x)))
    y = F.relu(self.bn2(self.conv2(y)))
    y = self.bn3(self.conv3(y))
    return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class TorchResNet(nn.Module):
  """torchvision's ResNet trunk (conv7x7/2, BN, ReLU, max-pool 3x3/2, the stages) without avgpool and fc."""

  def __init__(self, stage_sizes, block=TorchBasicBlock, in_channels: int = 3):
    super().__init__()
    self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
    self.bn1 = nn.BatchNorm2d(64)
    layers, cin = [], 64
    for i, blocks in enumerate(stage_sizes):
      stage = []
      for j in range(blocks):
        stage.append(block(cin, 64 * 2**i, 2 if i > 0 and j == 0 else 1))
        cin = 64 * 2**i * block.expansion
      layers.append(nn.Sequential(*stage))
    self.layers = nn.Sequential(*layers)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
    return self.layers(x)


class TorchInvertedResidual(nn.Module):
  def __init__(self, cin: int, cout: int, stride: int, expansion: int):
    super().__init__()
    hidden = cin * expansion
    self.expand = _conv_bn(cin, hidden, 1) if expansion != 1 else None
    self.depthwise = _conv_bn(hidden, hidden, 3, stride, groups=hidden)
    self.project = _conv_bn(hidden, cout, 1)
    self.residual = stride == 1 and cin == cout

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = x if self.expand is None else F.relu6(self.expand(x))
    y = self.project(F.relu6(self.depthwise(y)))
    return x + y if self.residual else y


class TorchMobileNetV2(nn.Module):
  """torchvision's mobilenet_v2 features (width 1.0): conv3x3/2 (32), 17 inverted residuals, conv1x1 (1280)."""
  SETTING = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
             (6, 320, 1, 1))

  def __init__(self, in_channels: int = 3):
    super().__init__()
    self.stem = _conv_bn(in_channels, 32, 3, 2)
    blocks, cin = [], 32
    for t, c, n, s in self.SETTING:
      for i in range(n):
        blocks.append(TorchInvertedResidual(cin, c, s if i == 0 else 1, t))
        cin = c
    self.blocks = nn.Sequential(*blocks)
    self.last = _conv_bn(cin, 1280, 1)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.relu6(self.last(self.blocks(F.relu6(self.stem(x)))))


class TorchBasicConv(nn.Module):
  """conv (no bias) -> BatchNorm(eps 1e-3) -> ReLU, torchvision's BasicConv2d."""

  def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1):
    super().__init__()
    self.conv = nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, bias=False)
    self.bn = nn.BatchNorm2d(cout, eps=1e-3)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    return F.relu(self.bn(self.conv(x)))


class TorchInception(nn.Module):
  def __init__(self, cin: int, widths):
    super().__init__()
    c1, r3, c3, r5, c5, pp = widths
    self.b1 = TorchBasicConv(cin, c1, 1)
    self.b2 = nn.Sequential(TorchBasicConv(cin, r3, 1), TorchBasicConv(r3, c3, 3))
    self.b3 = nn.Sequential(TorchBasicConv(cin, r5, 1), TorchBasicConv(r5, c5, 3))  # torchvision's "5x5" is 3x3
    self.b4 = TorchBasicConv(cin, pp, 1)
    self.out_channels = c1 + c3 + c5 + pp

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b4 = self.b4(F.max_pool2d(x, 3, 1, 1, ceil_mode=True))
    return torch.cat([self.b1(x), self.b2(x), self.b3(x), b4], 1)


class TorchGoogLeNet(nn.Module):
  """torchvision's googlenet trunk (aux_logits=False, transform_input off), without avgpool, dropout and fc."""
  INCEPTION_3 = ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64))
  INCEPTION_4 = ((192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
                 (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128))
  INCEPTION_5 = ((256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128))

  def __init__(self, in_channels: int = 3):
    super().__init__()
    self.conv1 = TorchBasicConv(in_channels, 64, 7, 2)
    self.conv2 = TorchBasicConv(64, 64, 1)
    self.conv3 = TorchBasicConv(64, 192, 3)
    stages, cin = [], 192
    for widths_of_stage in (self.INCEPTION_3, self.INCEPTION_4, self.INCEPTION_5):
      blocks = []
      for widths in widths_of_stage:
        blocks.append(TorchInception(cin, widths))
        cin = blocks[-1].out_channels
      stages.append(nn.Sequential(*blocks))
    self.stage3, self.stage4, self.stage5 = stages

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = F.max_pool2d(self.conv1(x), 3, 2, ceil_mode=True)
    x = F.max_pool2d(self.conv3(self.conv2(x)), 3, 2, ceil_mode=True)
    x = F.max_pool2d(self.stage3(x), 3, 2, ceil_mode=True)
    x = F.max_pool2d(self.stage4(x), 2, 2, ceil_mode=True)
    return self.stage5(x)


class TorchEncoderBlock(nn.Module):
  """torchvision's ViT EncoderBlock (dropout 0): x + MHA(LN(x)), x + MLP(LN(x)), exact GELU."""

  def __init__(self, hidden: int, heads: int, mlp_dim: int):
    super().__init__()
    self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
    self.self_attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
    self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
    self.mlp = nn.Sequential(nn.Linear(hidden, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, hidden))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    y = self.ln_1(x)
    x = x + self.self_attention(y, y, y, need_weights=False)[0]
    return x + self.mlp(self.ln_2(x))


class TorchViT(nn.Module):
  """torchvision's vit_b_16 / vit_b_32 at `image_size` without its heads: patchify, class token, learned position
  embeddings, 12 encoder blocks, LayerNorm; returns the class token [B, hidden]."""

  def __init__(self, patch: int, image_size: int = 32, in_channels: int = 3, hidden: int = 768, depth: int = 12,
               heads: int = 12, mlp_dim: int = 3072):
    super().__init__()
    self.conv_proj = nn.Conv2d(in_channels, hidden, patch, patch)
    tokens = (image_size // patch) ** 2 + 1
    self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
    self.pos_embedding = nn.Parameter(torch.empty(1, tokens, hidden).normal_(std=0.02))
    self.layers = nn.Sequential(*[TorchEncoderBlock(hidden, heads, mlp_dim) for _ in range(depth)])
    self.ln = nn.LayerNorm(hidden, eps=1e-6)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = self.conv_proj(x).flatten(2).transpose(1, 2)  # [B, tokens, hidden], row-major over the patch grid
    x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embedding
    return self.ln(self.layers(x))[:, 0]


class TorchGeFLCNN(nn.Module):
  """GeFL's CIFAR-10 CNN-k (Table XXIII; fedjax_het/models/gefl_cnn.py): the common block conv3-BN-ReLU,
  conv10-BN-ReLU, pool, then conv-ReLU-pool per width; flattened in (h, w, c) order, as fedjax_het's NHWC
  features are (their RM pools those features)."""

  def __init__(self, widths, in_channels: int = 3):
    super().__init__()
    self.fe_conv = nn.Conv2d(in_channels, 3, 3, 1, 1)
    self.fe_bn = nn.BatchNorm2d(3)
    self.fe_conv2 = nn.Conv2d(3, 10, 3, 1, 1)
    self.fe_bn2 = nn.BatchNorm2d(10)
    convs, cin = [], 10
    for w in widths:
      convs.append(nn.Conv2d(cin, w, 3, 1, 1))
      cin = w
    self.convs = nn.ModuleList(convs)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = F.relu(self.fe_bn(self.fe_conv(x)))
    x = F.max_pool2d(F.relu(self.fe_bn2(self.fe_conv2(x))), 2)
    for conv in self.convs:
      x = F.max_pool2d(F.relu(conv(x)), 2)
    return x.permute(0, 2, 3, 1).flatten(1)


RESNETS = {'resnet18': ((2, 2, 2, 2), TorchBasicBlock), 'resnet34': ((3, 4, 6, 3), TorchBasicBlock),
           'resnet50': ((3, 4, 6, 3), TorchBottleneck), 'resnet101': ((3, 4, 23, 3), TorchBottleneck),
           'resnet152': ((3, 8, 36, 3), TorchBottleneck)}
GEFL_CIFAR10_WIDTHS = {k: w for k, w in enumerate((
    (16,), (16, 32), (20, 40), (10, 20), (10, 32, 64), (20, 40, 80), (10, 20, 40), (16, 32, 64, 128),
    (20, 40, 80, 100), (10, 20, 40, 80)), start=1)}  # CNN-k's blocks after the common one (gefl_cnn.gefl_widths)
TORCH_MODELS = ('cnn4', 'mobilenet_v2', 'googlenet', *RESNETS, 'vit_b16', 'vit_b32',
                *(f'gefl_cifar10_cnn{k}' for k in GEFL_CIFAR10_WIDTHS))


def torch_model(name: str, num_classes: int = 10, feature_dim: int = 512, image_shape=(32, 32, 3)) -> nn.Module:
  """The PyTorch counterpart of fedjax_het's `build_model(name, num_classes, feature_dim)` (rm='ap') for images of
  `image_shape` (H, W, C): one of TORCH_MODELS."""
  h, _, c = image_shape
  if name == 'cnn4':
    side = ((h - 4) // 2 - 4) // 2
    return TorchCNN4(c, num_classes, 512, 64 * side * side)
  if name in RESNETS:
    extractor = TorchResNet(RESNETS[name][0], RESNETS[name][1], c)
  elif name == 'mobilenet_v2':
    extractor = TorchMobileNetV2(c)
  elif name == 'googlenet':
    extractor = TorchGoogLeNet(c)
  elif name in ('vit_b16', 'vit_b32'):
    extractor = TorchViT(int(name[-2:]), h, c)
  elif name.startswith('gefl_cifar10_cnn') and int(name[len('gefl_cifar10_cnn'):]) in GEFL_CIFAR10_WIDTHS:
    extractor = TorchGeFLCNN(GEFL_CIFAR10_WIDTHS[int(name[len('gefl_cifar10_cnn'):])], c)
  else:
    raise ValueError(f'no PyTorch model {name!r}; these exist: {", ".join(TORCH_MODELS)}')
  return TorchClassifier(extractor, num_classes, feature_dim)


def _copy(target: torch.Tensor, value, name: str) -> None:
  value = torch.from_numpy(np.array(value, np.float32))
  if tuple(target.shape) != tuple(value.shape):
    raise ValueError(f'{name}: fedjax_het has shape {tuple(value.shape)}, the PyTorch model {tuple(target.shape)}')
  target.copy_(value)


def _conv(conv: nn.Conv2d, p: dict, name: str) -> None:
  _copy(conv.weight, np.transpose(p['kernel'], (3, 2, 0, 1)), name + '.kernel')  # HWIO -> OIHW
  if conv.bias is not None:
    _copy(conv.bias, p['bias'], name + '.bias')


def _bn(bn: nn.BatchNorm2d, p: dict, s: dict, name: str) -> None:
  _copy(bn.weight, p['scale'], name + '.scale')
  _copy(bn.bias, p['bias'], name + '.bias')
  _copy(bn.running_mean, s['mean'], name + '.mean')
  _copy(bn.running_var, s['var'], name + '.var')


def _dense(linear: nn.Linear, p: dict, name: str) -> None:
  _copy(linear.weight, np.asarray(p['kernel']).T, name + '.kernel')
  _copy(linear.bias, p['bias'], name + '.bias')


def _layer_norm(ln: nn.LayerNorm, p: dict, name: str) -> None:
  _copy(ln.weight, p['scale'], name + '.scale')
  _copy(ln.bias, p['bias'], name + '.bias')


def _conv_bn_from(seq: nn.Sequential, p: dict, s: dict, name: str, conv: str = 'Conv_0', bn: str = 'BatchNorm_0'):
  _conv(seq[0], p[conv], f'{name}/{conv}')
  _bn(seq[1], p[bn], s[bn], f'{name}/{bn}')


def load_flax_classifier(name: str, model: nn.Module, params: dict, model_state: Optional[dict] = None
                         ) -> nn.Module:
  """Copies a fedjax_het classifier `name` (one client's params and model_state, NHWC/HWIO) into `model`, built by
  `torch_model(name)`: every parameter and BatchNorm statistic, each checked for its shape. flax names a
  module's submodules by class and order of construction (`Conv_0`, `BatchNorm_1`, ...), which the mapping
  follows."""
  if name == 'cnn4':
    return load_flax_params(model, params)
  p, s = params['extractor'], (model_state or {}).get('batch_stats', {}).get('extractor', {})
  e = model.extractor
  with torch.no_grad():
    if name in RESNETS:
      _conv(e.conv1, p['Conv_0'], 'stem')
      _bn(e.bn1, p['BatchNorm_0'], s['BatchNorm_0'], 'stem')
      kind = 'BasicBlock' if RESNETS[name][1] is TorchBasicBlock else 'Bottleneck'
      blocks = [b for stage in e.layers for b in stage]
      for i, block in enumerate(blocks):
        bp, bs, where = p[f'{kind}_{i}'], s[f'{kind}_{i}'], f'{kind}_{i}'
        convs = [block.conv1, block.conv2] + ([block.conv3] if kind == 'Bottleneck' else [])
        bns = [block.bn1, block.bn2] + ([block.bn3] if kind == 'Bottleneck' else [])
        for j, (conv, bn) in enumerate(zip(convs, bns)):
          _conv(conv, bp[f'Conv_{j}'], f'{where}/Conv_{j}')
          _bn(bn, bp[f'BatchNorm_{j}'], bs[f'BatchNorm_{j}'], f'{where}/BatchNorm_{j}')
        if block.downsample is not None:
          j = len(convs)
          _conv_bn_from(block.downsample, bp, bs, where, f'Conv_{j}', f'BatchNorm_{j}')
    elif name == 'mobilenet_v2':
      _conv_bn_from(e.stem, p['ConvBNReLU6_0'], s['ConvBNReLU6_0'], 'ConvBNReLU6_0')
      for i, block in enumerate(e.blocks):
        bp, bs, where = p[f'InvertedResidual_{i}'], s[f'InvertedResidual_{i}'], f'InvertedResidual_{i}'
        parts = [q for q in (block.expand, block.depthwise, block.project) if q is not None]
        for j, part in enumerate(parts):
          _conv_bn_from(part, bp[f'ConvBNReLU6_{j}'], bs[f'ConvBNReLU6_{j}'], f'{where}/ConvBNReLU6_{j}')
      _conv_bn_from(e.last, p['ConvBNReLU6_1'], s['ConvBNReLU6_1'], 'ConvBNReLU6_1')
    elif name == 'googlenet':
      def basic(conv: TorchBasicConv, bp, bs, where):
        _conv(conv.conv, bp['Conv_0'], where + '/Conv_0')
        _bn(conv.bn, bp['BatchNorm_0'], bs['BatchNorm_0'], where + '/BatchNorm_0')
      # flax names a module when it is constructed: in conv(c3, 3)(conv(r3, 1)(x)) the outer 3x3 comes first.
      for conv, k in ((e.conv1, 0), (e.conv3, 1), (e.conv2, 2)):
        basic(conv, p[f'BasicConv_{k}'], s[f'BasicConv_{k}'], f'BasicConv_{k}')
      blocks = [b for stage in (e.stage3, e.stage4, e.stage5) for b in stage]
      for i, block in enumerate(blocks):
        bp, bs, where = p[f'Inception_{i}'], s[f'Inception_{i}'], f'Inception_{i}'
        order = (block.b1, block.b2[1], block.b2[0], block.b3[1], block.b3[0], block.b4)
        for k, conv in enumerate(order):
          basic(conv, bp[f'BasicConv_{k}'], bs[f'BasicConv_{k}'], f'{where}/BasicConv_{k}')
    elif name in ('vit_b16', 'vit_b32'):
      _conv(e.conv_proj, p['Conv_0'], 'Conv_0')
      _copy(e.class_token, p['class_token'], 'class_token')
      _copy(e.pos_embedding, p['pos_embedding'], 'pos_embedding')
      hidden = e.class_token.shape[-1]
      for i, block in enumerate(e.layers):
        bp, where = p[f'EncoderBlock_{i}'], f'EncoderBlock_{i}'
        _layer_norm(block.ln_1, bp['LayerNorm_0'], where + '/LayerNorm_0')
        _layer_norm(block.ln_2, bp['LayerNorm_1'], where + '/LayerNorm_1')
        att = bp['MultiHeadDotProductAttention_0']
        # q, k, v kernels [hidden, heads, head_dim] -> rows of torch's in_proj [3 * hidden, hidden]
        _copy(block.self_attention.in_proj_weight, np.concatenate(
            [np.asarray(att[n]['kernel']).reshape(hidden, hidden).T for n in ('query', 'key', 'value')]),
            where + '/attention.qkv.kernel')
        _copy(block.self_attention.in_proj_bias, np.concatenate(
            [np.asarray(att[n]['bias']).reshape(hidden) for n in ('query', 'key', 'value')]),
            where + '/attention.qkv.bias')
        _copy(block.self_attention.out_proj.weight, np.asarray(att['out']['kernel']).reshape(hidden, hidden).T,
              where + '/attention.out.kernel')
        _copy(block.self_attention.out_proj.bias, att['out']['bias'], where + '/attention.out.bias')
        # flax constructs Dense(hidden) (the outer call) before Dense(mlp_dim)
        _dense(block.mlp[0], bp['Dense_1'], where + '/Dense_1')
        _dense(block.mlp[2], bp['Dense_0'], where + '/Dense_0')
      _layer_norm(e.ln, p['LayerNorm_0'], 'LayerNorm_0')
    elif name.startswith('gefl_cifar10_cnn'):
      _conv(e.fe_conv, p['fe_conv'], 'fe_conv')
      _bn(e.fe_bn, p['fe_bn'], s['fe_bn'], 'fe_bn')
      _conv(e.fe_conv2, p['fe_conv2'], 'fe_conv2')
      _bn(e.fe_bn2, p['fe_bn2'], s['fe_bn2'], 'fe_bn2')
      for i, conv in enumerate(e.convs):
        _conv(conv, p[f'conv{i}'], f'conv{i}')
    else:
      raise ValueError(f'no PyTorch model {name!r}; these exist: {", ".join(TORCH_MODELS)}')
    _dense(model.head, params['head'], 'head')
  return model


def parameter_count(model: nn.Module) -> int:
  """Trainable parameters of a PyTorch model (BatchNorm's running statistics are buffers, not counted)."""
  return sum(p.numel() for p in model.parameters())


def rap_weights(y: torch.Tensor, num_classes: int, generator: torch.Generator) -> torch.Tensor:
  """FedRE's RAP weights (Eq. 12): W_c = u_c / sum_present u, spread as W_c / n_c over class c's rows."""
  counts = torch.bincount(y, minlength=num_classes).float()
  u = torch.rand(num_classes, generator=generator, device=y.device) * (counts > 0)
  class_w = u / u.sum().clamp_min(1e-12)
  return (class_w / counts.clamp_min(1.0))[y]


class TorchFedRE:
  """K clients of TorchCNN4 (or the given `init_models`, one per client, any classifier with `represent` and a
  `head` of `feature_dim` inputs) and a global head, trained round by round in a Python loop.

  `train[k]` = (x [n_k, C, H, W] float32, y [n_k] int64) on `device`. `disk_io=True` keeps each client's model on
  disk between rounds, loading and saving it every round as HtFLlib does; otherwise models stay in memory.
  `max_steps`: at most that many SGD steps per client and round (fedjax_het's `LocalTraining.max_steps`).
  After each round `client_seconds[k]` holds client k's seconds (its training, representation pass and upload).
  """

  def __init__(self, train: list[tuple[torch.Tensor, torch.Tensor]], num_classes: int, learning_rate: float,
               batch_size: int, epochs: int = 1, server_learning_rate: float = 0.01, server_batch_size: int = 10,
               disk_io: bool = False, device: str = 'cpu', seed: int = 0, eval_batch_size: int = 256,
               init_models: Optional[list[nn.Module]] = None, max_steps: Optional[int] = None,
               feature_dim: int = 512):
    self.train, self.num_classes, self.device = train, num_classes, device
    self.max_steps, self.client_seconds = max_steps, {}
    self.lr, self.batch_size, self.epochs = learning_rate, batch_size, epochs
    self.server_lr, self.server_batch_size = server_learning_rate, server_batch_size
    self.eval_batch_size = eval_batch_size
    self.disk_io = disk_io
    torch.manual_seed(seed)
    self.generator = torch.Generator(device='cpu').manual_seed(seed)
    in_channels = train[0][0].shape[1]
    side = (train[0][0].shape[2] - 4) // 2
    flat = 64 * ((side - 4) // 2) ** 2
    models = init_models or [TorchCNN4(in_channels, num_classes, 512, flat) for _ in train]
    self.models = [m.to(device) for m in models]
    self.head = nn.Linear(feature_dim, num_classes).to(device)
    self.head.load_state_dict(self.models[0].head.state_dict())  # the global head starts as one client's
    self.steps = self.samples = 0
    if disk_io:
      self._dir = tempfile.TemporaryDirectory(prefix='torch_fedre_')
      for k, m in enumerate(self.models):
        torch.save(m, self._path(k))
      self.models = [None] * len(train)

  def _path(self, k: int) -> str:
    return os.path.join(self._dir.name, f'Client_{k}_model.pt')

  def _load(self, k: int) -> TorchCNN4:
    if self.disk_io:
      return torch.load(self._path(k), map_location=self.device, weights_only=False)
    return self.models[k]

  def _save(self, k: int, model: TorchCNN4) -> None:
    if self.disk_io:
      torch.save(model, self._path(k))

  def local_train(self, model: TorchCNN4, x: torch.Tensor, y: torch.Tensor,
                  batches: Optional[list[np.ndarray]] = None) -> list[float]:
    """Fresh SGD, `epochs` shuffled drop_last epochs of CE (or the given batches of row indices); returns the
    step losses."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=self.lr)
    if batches is None:
      loader = DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True, drop_last=True,
                          generator=self.generator)
      batches_xy = (b for _ in range(self.epochs) for b in loader)
    else:
      batches_xy = ((x[torch.as_tensor(b)], y[torch.as_tensor(b)]) for b in batches)
    losses = []
    for xb, yb in batches_xy:
      if self.max_steps is not None and len(losses) == self.max_steps:
        break
      opt.zero_grad()
      loss = F.cross_entropy(model(xb), yb)
      loss.backward()
      opt.step()
      losses.append(loss.item())
      self.steps += 1
      self.samples += len(yb)
    return losses

  @torch.no_grad()
  def represent(self, model: TorchCNN4, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return torch.cat([model.represent(xb) for xb in torch.split(x, self.eval_batch_size)])

  def round(self, participants: Optional[list[int]] = None) -> dict:
    """One FedRE round over the participants (default: every client); returns the mean client loss and the server
    loss."""
    reps, labels, client_losses = [], [], []
    self.client_seconds = {}
    for k in range(len(self.train)) if participants is None else participants:
      start = time.perf_counter()
      x, y = self.train[k]
      model = self._load(k)
      model.head.load_state_dict(self.head.state_dict())
      client_losses.append(np.mean(self.local_train(model, x, y) or [0.0]))
      r = self.represent(model, x)
      w = rap_weights(y.cpu(), self.num_classes, self.generator).to(r.device)
      reps.append(w @ r)
      labels.append(w @ F.one_hot(y, self.num_classes).float())
      self._save(k, model)
      if self.device.startswith('cuda'):
        torch.cuda.synchronize()
      self.client_seconds[k] = time.perf_counter() - start
    server_loss = self.server_step(torch.stack(reps), torch.stack(labels))
    if self.device.startswith('cuda'):
      torch.cuda.synchronize()
    return {'train_loss': float(np.mean(client_losses)), 'server_loss': server_loss}

  def server_step(self, reps: torch.Tensor, soft: torch.Tensor) -> float:
    """Eq. 3: one epoch of SGD on the global head, summed soft-label CE over batches of uploaded rows."""
    opt = torch.optim.SGD(self.head.parameters(), lr=self.server_lr)
    total = 0.0
    for rb, sb in DataLoader(TensorDataset(reps, soft), batch_size=self.server_batch_size, shuffle=True,
                             generator=self.generator):
      opt.zero_grad()
      loss = -(sb * F.log_softmax(self.head(rb), -1)).sum()
      loss.backward()
      opt.step()
      total += loss.item()
    return total / max(len(reps), 1)


def client_tensors(x: np.ndarray, y: np.ndarray, n: np.ndarray, device: str = 'cpu'
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
  """fedjax_het's padded group arrays (x [K, n_max, H, W, C], y, n) -> per-client NCHW tensors of real rows."""
  return [(torch.from_numpy(np.ascontiguousarray(np.asarray(x[k, :n[k]]).transpose(0, 3, 1, 2))).to(device),
           torch.from_numpy(np.asarray(y[k, :n[k]]).astype(np.int64)).to(device)) for k in range(len(n))]
