"""GeFL's conditional VAE ("GeFL: Model-Agnostic Federated Learning with Generative Models",
App. C-A2, Table XVIII), on 32x32 images in [0, 1].

Encoder: the image concatenated with one constant channel holding the integer label (not normalised, as the
code) -> 5 x [Conv(k4, s2, p1) BN ReLU] with widths w, 2w, 4w, 8w, 16w (32 -> 1) -> Linear(16w, l) for mu and
for logvar. Decoder: Linear(l + C, 16w) ReLU -> 16w x 1 x 1 -> ConvT(k4, s2, p1) to 8w, 4w, 2w, w (each BN ReLU)
-> ConvT(w, c, k4, s2, p1) ReLU. Paper size w = 64, l = 16 (MNIST; 50 for CIFAR-10): 22,354,593 parameters, the
decoder 11,172,673 (Table V's 22.35M / 11.17M). CVAE-F (GeFL-F, 16x16 feature maps): four encoder blocks (w .. 8w,
16 -> 1) and decoder Linear(l + C, 8w), ConvT to 4w, 2w, w, then c with ReLU: 5,542,561 parameters at c = 1, the
count behind Table VI's 5.543M (the code hard-codes one channel; GeFL-F's features have c = 3).

Loss per batch (code): MSE(x', x) summed over pixels and the batch + KL summed over the batch, KL = -0.5 sum(1 +
logvar - mu^2 - exp(logvar)); Adam(1e-3) with weight decay 1e-3 as an L2 term (PyTorch's Adam). Layers keep
PyTorch's default initialisation. Samples: z ~ N(0, I_l) decoded in eval mode with the label's one-hot.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_het.generators.base import ConditionalGenerator, gaussian_kl
from fedjax_het.models.conv import conv_factory, conv_transpose
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.layers import Dense
from fedjax_het.models.norm import TorchBatchNorm, batch_rows
from fedjax_het.optim import step_at_rate, torch_adam
from fedjax_het.rows import row_weights


class CVAEEncoder(nn.Module):
  """(x [B, S, S, c], y [B]) -> (mu, logvar) [B, latent]; log2(S) conv blocks take S x S down to 1 x 1."""
  width: int = 64
  latent: int = 16
  conv: str = 'xla'

  @nn.compact
  def __call__(self, x: jnp.ndarray, y: jnp.ndarray, train: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
    label = jnp.broadcast_to(y.astype(x.dtype)[:, None, None, None], x.shape[:3] + (1,))
    h = jnp.concatenate([x, label], -1)
    for i in range(x.shape[1].bit_length() - 1):
      h = conv_factory(self.conv)(self.width * 2 ** i, (4, 4), strides=(2, 2), padding=[(1, 1)] * 2,
                                  name=f'conv{i}')(h)
      h = nn.relu(TorchBatchNorm(use_running_average=not train, name=f'bn{i}')(h))
    h = h.reshape(h.shape[0], -1)
    return Dense(self.latent, name='mu')(h), Dense(self.latent, name='logvar')(h)


class CVAEDecoder(nn.Module):
  """(z [B, latent], y_onehot [B, C]) -> images [B, S, S, c] >= 0 (ReLU), S = `size` (32, or 16 for CVAE-F)."""
  width: int = 64
  channels: int = 1
  conv: str = 'xla'
  size: int = 32

  @nn.compact
  def __call__(self, z: jnp.ndarray, y_onehot: jnp.ndarray, train: bool) -> jnp.ndarray:
    layers = self.size.bit_length() - 1  # 1 x 1 -> S x S, doubling each
    mults = [2 ** (layers - 2 - i) for i in range(layers - 1)]  # 8, 4, 2, 1 for S = 32
    h = nn.relu(Dense(2 * mults[0] * self.width, name='fc')(jnp.concatenate([z, y_onehot], -1)))
    h = h[:, None, None, :]
    for i, mult in enumerate(mults):
      h = conv_transpose(self.conv, h, self.width * mult, 4, 2, 1, f'convt{i}')
      h = nn.relu(TorchBatchNorm(use_running_average=not train, name=f'bn{i}')(h))
    return nn.relu(conv_transpose(self.conv, h, self.channels, 4, 2, 1, f'convt{len(mults)}'))


class CVAE(nn.Module):
  """Encoder and decoder; __call__(x, y, eps, train) -> (reconstruction, mu, logvar) with z = mu + exp(logvar /
  2) * eps."""
  num_classes: int
  channels: int = 1
  width: int = 64
  latent: int = 16
  conv: str = 'xla'
  size: int = 32

  def setup(self):
    self.encoder = CVAEEncoder(self.width, self.latent, self.conv)
    self.decoder = CVAEDecoder(self.width, self.channels, self.conv, self.size)

  def __call__(self, x, y, eps, train: bool):
    mu, logvar = self.encoder(x, y, train)
    z = mu + jnp.exp(0.5 * logvar) * eps
    return self.decoder(z, jax.nn.one_hot(y, self.num_classes), train), mu, logvar

  def decode(self, z, y, train: bool = False):
    return self.decoder(z, jax.nn.one_hot(y, self.num_classes), train)


def cvae_loss(reconstruction: jnp.ndarray, x: jnp.ndarray, mu: jnp.ndarray, logvar: jnp.ndarray,
              mask: jnp.ndarray | None = None) -> jnp.ndarray:
  """sum over the batch and pixels of (x' - x)^2, plus the KL summed over the batch: -0.5 sum(1 + logvar - mu^2 -
  exp(logvar)); both over the rows where mask [B] is True when given."""
  squared = (reconstruction - x) ** 2
  return jnp.sum(squared * row_weights(mask, squared)) + gaussian_kl(mu, logvar, mask)


def cvae(num_classes: int, channels: int = 1, width: int = 64, latent: int = 16, learning_rate: float = 1e-3,
         weight_decay: float = 1e-3, conv: str = 'xla', size: int = 32) -> ConditionalGenerator:
  """GeFL's CVAE as a `ConditionalGenerator` (variables of `CVAE`) on size x size inputs: 32 (images in [0, 1]) or
  16 (GeFL-F's CVAE-F on feature maps, never range-mapped)."""
  if size not in (16, 32):
    raise ValueError(f'CVAE takes 32x32 images or 16x16 feature maps, not {size}x{size}.')
  model = CVAE(num_classes, channels, width, latent, conv, size)
  optimizer = torch_adam(learning_rate, weight_decay=weight_decay)

  def init(key):
    variables = model.init(key, jnp.zeros((1, size, size, channels)), jnp.zeros(1, jnp.int32),
                           jnp.zeros((1, latent)), False)
    return {**variables, 'params': torch_default_init(variables['params'], jax.random.fold_in(key, 1))}

  def step(variables, opt_state, x, y, key, lr_scale=1.0, mask=None):
    eps = jax.random.normal(key, (x.shape[0], latent))

    def loss(params):
      with batch_rows(mask):
        (recon, mu, logvar), state = model.apply({**variables, 'params': params}, x, y, eps, True,
                                                 mutable=['batch_stats'])
      return cvae_loss(recon, x, mu, logvar, mask), state['batch_stats']
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(variables['params'])
    params, opt_state = step_at_rate(optimizer, variables['params'], grads, opt_state, learning_rate * lr_scale)
    return {'params': params, 'batch_stats': stats}, opt_state, value

  def sample(variables, labels, key):
    z = jax.random.normal(key, (labels.shape[0], latent))
    return model.apply(variables, z, labels, False, method=CVAE.decode)

  return ConditionalGenerator('cvae', init, lambda v: optimizer.init(v['params']), step, sample,
                              unit_range=size == 32)
