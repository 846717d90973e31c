"""Convolutional and dense extractors: HtFLlib's 4-layer CNN, HeteroFL's CNN and small models for the offline
quickstart."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fedjax_het.models.layers import Conv, Dense
from fedjax_het.models.norm import TorchBatchNorm
from fedjax_het.models.pooling import max_pool


class FedAvgCNN(nn.Module):
  """HtFLlib's `FedAvgCNN` extractor: conv32 k5 -> ReLU -> pool2 -> conv64 k5 -> ReLU -> pool2 -> fc512 -> ReLU.

  With the head (512 -> C) this is the "4-layer CNN" of FedRE/HtFLlib; its feature width is already 512.
  """
  width: int = 512
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = max_pool(nn.relu(self.conv(32, (5, 5), padding='VALID')(x)), (2, 2), (2, 2))
    x = max_pool(nn.relu(self.conv(64, (5, 5), padding='VALID')(x)), (2, 2), (2, 2))
    return nn.relu(Dense(self.width)(x.reshape(x.shape[0], -1)))


class SmallCNN(nn.Module):
  """A small CNN for small images (e.g. 8x8 digits): two 3x3 conv blocks, then fc `width` -> ReLU."""
  channels: tuple[int, int] = (32, 64)
  width: int = 512
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    for c in self.channels:
      x = max_pool(nn.relu(self.conv(c, (3, 3), padding='SAME')(x)), (2, 2), (2, 2), padding='SAME')
    return nn.relu(Dense(self.width)(x.reshape(x.shape[0], -1)))


class MLP(nn.Module):
  """A dense extractor: flatten -> (Dense -> ReLU) per hidden width."""
  widths: tuple[int, ...] = (512, 512)

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = x.reshape(x.shape[0], -1)
    for w in self.widths:
      x = nn.relu(Dense(w)(x))
    return x


class HeteroFLConv(nn.Module):
  """HeteroFL's CNN (Diao et al. 2021, its `conv` model): per width w_i a 3x3 conv -> BatchNorm -> ReLU, a 2x2 max
  pool between blocks; returns the last feature map (RM averages it over positions, as the model's adaptive
  average pool). Its widths scale with HeteroFL's rate (`models.registry`, 'heterofl_conv@0.5')."""
  widths: tuple[int, ...] = (64, 128, 256, 512)
  conv: Any = Conv

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    for i, w in enumerate(self.widths):
      if i:
        x = max_pool(x, (2, 2), (2, 2))
      x = nn.relu(TorchBatchNorm(use_running_average=not train)(self.conv(w, (3, 3), padding=1)(x)))
    return x
