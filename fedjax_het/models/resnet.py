"""ResNets with the torchvision layout and stem (conv7x7/2, BN, ReLU, maxpool3x3/2), as HtFLlib uses them:
basic blocks for ResNet-4/6/8/10 (HtFLlib's, one block per stage, 1-4 stages), 18 and 34; bottleneck blocks
(expansion 4) for ResNet-50/101/152.

CIFAR-style ResNets (`stem='cifar'`: one conv3x3/1, no max-pool, so a 32x32 image keeps its resolution into the
first stage), as the CIFAR references build them: post-activation (the ResNet-18 of "Deep Residual Learning for
Image Recognition"'s CIFAR adaptation, FedType's code) or pre-activation blocks (`PreActBlock`, "Identity Mappings
in Deep Residual Networks", He et al. 2016: HeteroFL's ResNet-18), and the three-stage 16/32/64 ResNet-20/56 of
the original paper's Sec. 4.2 (FedGKT's family)."""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv, Dense
from fedjax_het.models.norm import TorchBatchNorm
from fedjax_het.models.repeat import apply_blocks


def _residual(x: jnp.ndarray, y: jnp.ndarray, strides: int, conv, norm) -> jnp.ndarray:
  """ReLU(shortcut(x) + y): identity, or a strided 1x1 projection + BN when the shape changes (torchvision's
  downsample)."""
  if x.shape[-1] != y.shape[-1] or strides != 1:
    x = norm()(conv(y.shape[-1], (1, 1), strides, use_bias=False)(x))
  return nn.relu(x + y)



class _Block(nn.Module):
  """A residual block's settings: its width, the stride of its first convolution, the convolution to build."""
  filters: int
  strides: int = 1
  conv: Any = Conv


class BasicBlock(_Block):
  """Two 3x3 convs with a projection shortcut when the shape changes (ResNet-18/34)."""

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    norm = functools.partial(TorchBatchNorm, use_running_average=not train)
    y = nn.relu(norm()(self.conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(x)))
    y = norm()(self.conv(self.filters, (3, 3), padding=1, use_bias=False)(y))
    return _residual(x, y, self.strides, self.conv, norm)


class PreActBlock(_Block):
  """A pre-activation basic block: BN-ReLU-conv3x3(stride)-BN-ReLU-conv3x3, added to the input or, when the shape
  changes, to a strided 1x1 projection of the pre-activated input (He et al. 2016, "Identity Mappings")."""

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    norm = functools.partial(TorchBatchNorm, use_running_average=not train)
    out = nn.relu(norm()(x))
    shortcut = x
    if x.shape[-1] != self.filters or self.strides != 1:
      shortcut = self.conv(self.filters, (1, 1), self.strides, use_bias=False)(out)
    y = self.conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(out)
    y = self.conv(self.filters, (3, 3), padding=1, use_bias=False)(nn.relu(norm()(y)))
    return y + shortcut


class Bottleneck(_Block):
  """torchvision's Bottleneck: 1x1 (filters) -> 3x3 (filters, stride) -> 1x1 (4 * filters), projection shortcut
  when the shape changes (ResNet-50/101/152)."""

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    norm = functools.partial(TorchBatchNorm, use_running_average=not train)
    y = nn.relu(norm()(self.conv(self.filters, (1, 1), use_bias=False)(x)))
    y = nn.relu(norm()(self.conv(self.filters, (3, 3), self.strides, padding=1, use_bias=False)(y)))
    y = norm()(self.conv(4 * self.filters, (1, 1), use_bias=False)(y))
    return _residual(x, y, self.strides, self.conv, norm)


STEMS = ('imagenet', 'cifar')


class ResNet(nn.Module):
  """torchvision ResNet trunk without its fc layer; returns the final feature map [B, H, W, channels]
  (512 for ResNet-10/18/34, 2048 for ResNet-50+, 64 * 2^(stages-1) for HtFLlib's shallower ones). stem:
  'imagenet' (conv7x7/2, BN, ReLU, max-pool 3x3/2) or 'cifar' (conv3x3/1, and BN-ReLU unless the blocks are
  pre-activation, whose trunk ends in BN-ReLU instead). scan: each stage's blocks after its first (identical ones)
  as one scanned block (models/repeat.py: the same variables, the numbers up to float32 rounding, less to
  compile)."""
  stage_sizes: Sequence[int]
  base_width: int = 64
  conv: Any = Conv
  block: Any = BasicBlock
  stage_widths: Optional[Sequence[int]] = None  # per stage (the stem takes the first); default base * 2^stage
  stem: str = 'imagenet'
  scan: bool = False

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    widths = self.stage_widths or [self.base_width * 2**i for i in range(len(self.stage_sizes))]
    norm = lambda: TorchBatchNorm(use_running_average=not train)
    pre_activation = self.block is PreActBlock
    if self.stem == 'cifar':
      x = self.conv(widths[0], (3, 3), 1, padding=1, use_bias=False)(x)
      x = x if pre_activation else nn.relu(norm()(x))
    else:
      x = nn.relu(norm()(self.conv(widths[0], (7, 7), 2, padding=3, use_bias=False)(x)))
      x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
    self.sow('intermediates', 'stem', x)  # the stem's map: where FedGKT's code cuts its client (`--gkt_split`)
    kind, first = self.block.__name__, 0  # blocks named as flax would name them: Bottleneck_0, Bottleneck_1, ...
    for i, blocks in enumerate(self.stage_sizes):
      if not blocks:
        continue
      x = self.block(widths[i], strides=2 if i > 0 else 1, conv=self.conv, name=f'{kind}_{first}')(x, train)
      make = functools.partial(self.block, widths[i], conv=self.conv)
      x = apply_blocks(self, make, [f'{kind}_{first + j}' for j in range(1, blocks)], x, train, scan=self.scan)
      first += blocks
    return nn.relu(norm()(x)) if pre_activation else x


class StemlessResNet(nn.Module):
  """A ResNet's stages on a feature map, without the stem, then the mean over positions and Dense(num_classes):
  FedGKT's server model (its ResNet-56 server: the CIFAR ResNet's three stages of bottlenecks, 16/32/64 filters,
  on the clients' 16-channel maps). A vector [B, L] is read as a 1x1 map."""
  num_classes: int
  blocks: int = 6
  widths: Sequence[int] = (16, 32, 64)
  conv: Any = Conv

  @nn.compact
  def __call__(self, h: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    if h.ndim == 2:
      h = h[:, None, None, :]
    for i, width in enumerate(self.widths):
      for j in range(self.blocks):
        h = Bottleneck(width, strides=2 if i > 0 and j == 0 else 1, conv=self.conv)(h, train)
    return Dense(self.num_classes)(h.mean(axis=(1, 2)))
