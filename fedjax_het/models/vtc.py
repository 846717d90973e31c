"""FedVTC's variational transposed-convolution decoder psi ("Bridging Generalization Gap of Heterogeneous Federated
Clients Using Generative Models", Table 6).

psi reshapes a latent v in R^p to (c0, H/4, W/4), as PyTorch's `view` does (channel-major), then runs four
transposed convolutions, each followed by PyTorch-default BatchNorm: k3 s1 p1 + LeakyReLU(0.01), k4 s2 p1 +
LeakyReLU, k3 s1 p1 + LeakyReLU, k4 s2 p1 + Sigmoid, so it outputs images in [0, 1] of the data's size. Layouts
per image shape (the paper's three, and a small one for scikit-learn's 8x8 digits):

  28x28x1 (MNIST):        p = 980   = 20x7x7,    widths 16, 32, 32 ->  21,043 trainable parameters
  32x32x3 (CIFAR-10/100): p = 4096  = 64x8x8,    widths 32, 64, 64 ->  91,625
  64x64x3 (TinyImageNet): p = 32768 = 128x16x16, widths 64, 64, 64 -> 179,785  (Table 5's "12768" is a typo)
  8x8x1   (digits):       p = 80    = 20x2x2,    widths 16, 32, 32

Other image sizes divisible by 4 use c0 = p / (H/4 * W/4) and the CIFAR widths (3 channels) or the MNIST ones.
A transposed convolution of stride s and padding p is computed as what it is: a convolution over the input
dilated with s - 1 zeros between rows and columns and padded by k - 1 - p, with the run's convolution formulation
(`models.conv`, --conv), so under vmap on CPU it can run as im2col instead of XLA's slow grouped, input-dilated
convolution. It equals PyTorch's ConvTranspose2d with the kernel flipped and its axes swapped, a
reparametrisation of a learned kernel. Kernels are initialised as PyTorch initialises ConvTranspose2d
(U(+-1/sqrt(fan_in)) with fan_in = out_channels * k * k, the weight's second axis in PyTorch's layout), not by
the library's Conv/Dense rule.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_het.errors import ConfigError
from fedjax_het.models.conv import conv_transpose
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.norm import TorchBatchNorm

# image shape (H, W, C) -> (latent channels c0, widths of the first three layers)
VTC_LAYOUTS = {
    (28, 28, 1): (20, (16, 32, 32)),
    (32, 32, 3): (64, (32, 64, 64)),
    (64, 64, 3): (128, (64, 64, 64)),
    (8, 8, 1): (20, (16, 32, 32)),
}


def vtc_layout(image_shape: tuple[int, ...], latent_dim: int) -> tuple[int, tuple[int, int, int]]:
  """(c0, widths) of the VTC for images of `image_shape` (H, W, C) and latents of width p = `latent_dim`, or a
  ConfigError naming --feature_dim when p does not reshape to (c0, H/4, W/4)."""
  h, w, c = image_shape
  if h % 4 or w % 4:
    raise ConfigError(f'FedVTC: the VTC decoder doubles the latent grid twice, so image height and width must be '
                      f'multiples of 4; got {h}x{w}. Fix: resize the dataset.')
  cells = (h // 4) * (w // 4)
  if tuple(image_shape) in VTC_LAYOUTS:
    c0, widths = VTC_LAYOUTS[tuple(image_shape)]
    if latent_dim != c0 * cells:
      raise ConfigError(f'FedVTC on {h}x{w}x{c} images: ModelConfig.feature_dim must be p = {c0 * cells} ('
                        f'{c0}x{h // 4}x{w // 4}, the VTC latent of Table 6 of the FedVTC paper); got {latent_dim}.')
    return c0, widths
  if latent_dim % cells:
    raise ConfigError(f'FedVTC on {h}x{w}x{c} images: ModelConfig.feature_dim={latent_dim} must be a multiple of '
                      f'{cells} (= {h // 4}x{w // 4}) to reshape into the VTC latent grid.')
  return latent_dim // cells, ((32, 64, 64) if c == 3 else (16, 32, 32))


class VTCDecoder(nn.Module):
  """psi: latents [B, p] -> images [B, H, W, C] in [0, 1] (Sigmoid), BatchNorm after every layer. `conv`: the
  convolution formulation (`models.conv.CONV_IMPLS`)."""
  image_shape: tuple[int, ...]
  latent_dim: int
  conv: str = 'xla'

  @nn.compact
  def __call__(self, v: jnp.ndarray, train: bool) -> jnp.ndarray:
    h, w, c = self.image_shape
    c0, widths = vtc_layout(self.image_shape, self.latent_dim)
    x = v.reshape((-1, c0, h // 4, w // 4)).transpose(0, 2, 3, 1)  # PyTorch's view(c0, h, w), then NHWC
    layers = [(widths[0], 3, 1, 1), (widths[1], 4, 2, 1), (widths[2], 3, 1, 1), (c, 4, 2, 1)]
    for i, (features, k, stride, pad) in enumerate(layers):
      x = conv_transpose(self.conv, x, features, k, stride, pad, f'convt{i}')
      x = TorchBatchNorm(use_running_average=not train, name=f'bn{i}')(x)
      x = nn.leaky_relu(x, 0.01) if i < 3 else nn.sigmoid(x)
    return x


def init_vtc(decoder: VTCDecoder, key: jax.Array) -> dict:
  """psi's variables {'params', 'batch_stats'}, the ConvTranspose kernels and biases drawn as PyTorch's
  ConvTranspose2d draws them (U(+-1/sqrt(out_channels * k * k))), each layer from `key` and its name."""
  variables = decoder.init(key, jnp.zeros((1, decoder.latent_dim)), False)
  return {'params': torch_default_init(variables['params'], key), 'batch_stats': variables['batch_stats']}
