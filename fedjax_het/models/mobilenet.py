"""MobileNetV2 (Sandler et al. 2018) with torchvision's layout (width 1.0), without its classifier."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv
from fedjax_het.models.norm import TorchBatchNorm


# (expansion t, output channels c, repeats n, first stride s): torchvision's inverted_residual_setting.
INVERTED_RESIDUALS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                      (6, 320, 1, 1))


class ConvBNReLU6(nn.Module):
  """conv (no bias) -> BN -> ReLU6; depthwise when groups == input channels."""
  features: int
  kernel: int = 3
  strides: int = 1
  groups: int = 1
  activation: bool = True
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    x = self.conv(self.features, (self.kernel, self.kernel), self.strides, padding=(self.kernel - 1) // 2,
             feature_group_count=self.groups, use_bias=False)(x)
    x = TorchBatchNorm(use_running_average=not train)(x)
    return jnp.clip(x, 0.0, 6.0) if self.activation else x


class InvertedResidual(nn.Module):
  """1x1 expansion (t > 1) -> 3x3 depthwise (stride) -> 1x1 linear projection; identity shortcut when the stride
  is 1 and the channels match."""
  features: int
  strides: int
  expansion: int
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool) -> jnp.ndarray:
    hidden = x.shape[-1] * self.expansion
    y = x
    if self.expansion != 1:
      y = ConvBNReLU6(hidden, 1, conv=self.conv)(y, train)
    y = ConvBNReLU6(hidden, 3, self.strides, groups=hidden, conv=self.conv)(y, train)
    y = ConvBNReLU6(self.features, 1, activation=False, conv=self.conv)(y, train)
    return x + y if self.strides == 1 and x.shape[-1] == self.features else y


class MobileNetV2(nn.Module):
  """torchvision mobilenet_v2 features: stem conv 3x3/2 (32) -> 17 inverted residuals -> conv 1x1 (1280).
  Returns the feature map [B, H, W, 1280]."""
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = ConvBNReLU6(32, 3, 2, conv=self.conv)(x, train)
    for t, c, n, s in INVERTED_RESIDUALS:
      for i in range(n):
        x = InvertedResidual(c, s if i == 0 else 1, t, conv=self.conv)(x, train)
    return ConvBNReLU6(1280, 1, conv=self.conv)(x, train)
