"""GoogLeNet (Szegedy et al. 2015) with torchvision's layout, without auxiliary heads and classifier (HtFLlib:
`googlenet(aux_logits=False)`). As in torchvision, the "5x5" branch of each Inception block is a 3x3 convolution,
convolutions are followed by BatchNorm (eps 1e-3), and max pools use ceil mode."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv
from fedjax_het.models.norm import TorchBatchNorm

# (1x1, 3x3 reduce, 3x3, "5x5" reduce, "5x5", pool projection) per Inception block: torchvision's.
INCEPTION_3 = ((64, 96, 128, 16, 32, 32), (128, 128, 192, 32, 96, 64))
INCEPTION_4 = ((192, 96, 208, 16, 48, 64), (160, 112, 224, 24, 64, 64), (128, 128, 256, 24, 64, 64),
               (112, 144, 288, 32, 64, 64), (256, 160, 320, 32, 128, 128))
INCEPTION_5 = ((256, 160, 320, 32, 128, 128), (384, 192, 384, 48, 128, 128))


def max_pool_ceil(x: jnp.ndarray, window: int, stride: int, padding: int = 0) -> jnp.ndarray:
  """torch's MaxPool2d(window, stride, padding, ceil_mode=True) on NHWC: extra -inf padding at the end so the
  output has ceil((H + 2p - k) / s) + 1 rows, minus one if the last window would start in the end padding."""
  pads = []
  for size in x.shape[1:3]:
    out = -(-(size + 2 * padding - window) // stride) + 1
    if (out - 1) * stride >= size + padding:
      out -= 1
    pads.append((padding, max(0, (out - 1) * stride + window - size - padding)))
  return nn.max_pool(x, (window, window), (stride, stride), padding=pads)


class BasicConv(nn.Module):
  """conv (no bias) -> BatchNorm(eps 1e-3) -> ReLU, torchvision's BasicConv2d."""
  features: int
  kernel: int
  strides: int = 1
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    x = self.conv(self.features, (self.kernel, self.kernel), self.strides, padding=(self.kernel - 1) // 2,
                  use_bias=False)(x)
    return nn.relu(TorchBatchNorm(use_running_average=not train, epsilon=1e-3)(x))


class Inception(nn.Module):
  """Four branches concatenated on channels: 1x1; 1x1 -> 3x3; 1x1 -> 3x3; maxpool 3x3/1 (ceil) -> 1x1."""
  widths: tuple[int, int, int, int, int, int]
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    c1, r3, c3, r5, c5, pp = self.widths
    conv = functools.partial(BasicConv, conv=self.conv)
    b1 = conv(c1, 1)(x, train)
    b2 = conv(c3, 3)(conv(r3, 1)(x, train), train)
    b3 = conv(c5, 3)(conv(r5, 1)(x, train), train)
    b4 = conv(pp, 1)(max_pool_ceil(x, 3, 1, 1), train)
    return jnp.concatenate([b1, b2, b3, b4], axis=-1)


class GoogLeNet(nn.Module):
  """torchvision googlenet trunk (transform_input off): returns the feature map [B, H, W, 1024]."""
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    conv = functools.partial(BasicConv, conv=self.conv)
    x = max_pool_ceil(conv(64, 7, 2)(x, train), 3, 2)
    x = conv(192, 3)(conv(64, 1)(x, train), train)
    x = max_pool_ceil(x, 3, 2)
    for widths in INCEPTION_3:
      x = Inception(widths, self.conv)(x, train)
    x = max_pool_ceil(x, 3, 2)
    for widths in INCEPTION_4:
      x = Inception(widths, self.conv)(x, train)
    x = max_pool_ceil(x, 2, 2)
    for widths in INCEPTION_5:
      x = Inception(widths, self.conv)(x, train)
    return x
