"""GeFL's conditional DCGAN ("GeFL: Model-Agnostic Federated Learning with Generative Models",
App. C-A1, Table XVII), on 32x32 images.

G (width d_g): z [100] -> ConvT(100, 2d_g, 4, 1, 0) BN ReLU and y one-hot [10] -> ConvT(10, 2d_g, 4, 1, 0) BN
ReLU, concatenated (4d_g x 4 x 4) -> ConvT(4d_g, 2d_g, 4, 2, 1) BN ReLU -> ConvT(2d_g, d_g, 4, 2, 1) BN ReLU ->
ConvT(d_g, c, 4, 2, 1) tanh: images in [-1, 1]. (Table XVII's second step prints (2d_g, 2d_g); the code and the
parameter counts say 2d_g -> d_g. The code hard-codes c = 1; here c is the data's.)
D (width d_d): x -> Conv(c, d_d/2, 4, 2, 1) LReLU(0.2) and y one-hot planes [H, W, 10] -> Conv(10, d_d/2, 4, 2,
1) LReLU, concatenated -> Conv(d_d, 2d_d, 4, 2, 1) BN LReLU -> Conv(2d_d, 4d_d, 4, 2, 1) BN LReLU ->
Conv(4d_d, 1, 4, 1, 0) sigmoid.
MNIST sizes (d_g, d_d, c) = (128, 128, 1): G 3,076,737 + D 2,643,329 = 5.72M parameters (Table V).
DCGAN-F (GeFL-F, on 16x16 feature maps): G's heads and middle layer with LeakyReLU(0.2), then ConvT(2d_g, c, 4, 2,
1) ReLU (16x16); D with a 2x2 last kernel. Table VI's 2.554M (G) and 5.191M (G + D) are the counts at c = 1 (the
code hard-codes one channel); GeFL-F's features have c = 3.

Training (per real batch, as the code): a D-step on BCE(D(x, y), 1) + BCE(D(G(z', y'), y'), 0) with y' uniform
over the classes and z' ~ N(0, I_100) (the appendix says uniform noise; the code draws randn), then a G-step on
BCE(D(G(z'', y''), y''), 1) with fresh draws; both with Adam(2e-4, betas (0.5, 0.999)); G and D in train mode
throughout (every pass updates its BatchNorm statistics, as PyTorch's). Weights N(0, 0.02), biases 0. Samples
come from G in eval mode (the code's `gennet.eval()`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_het.generators.base import ConditionalGenerator, bce, uniform_labels
from fedjax_het.models.conv import conv_factory, conv_transpose
from fedjax_het.models.norm import TorchBatchNorm, batch_rows
from fedjax_het.optim import step_at_rate, torch_adam

NOISE_DIM = 100


class DCGANGenerator(nn.Module):
  """G(z [B, 100], y_onehot [B, C]) -> images [B, 32, 32, channels] in [-1, 1]; with `features` (DCGAN-F) feature
  maps [B, 16, 16, channels] >= 0: LeakyReLU(0.2) after the heads and the middle layer, no 16x16 -> 32x32 layer,
  ReLU out."""
  width: int = 128
  channels: int = 1
  conv: str = 'xla'
  features: bool = False

  @nn.compact
  def __call__(self, z: jnp.ndarray, y_onehot: jnp.ndarray, train: bool) -> jnp.ndarray:
    d = self.width
    act = (lambda h: nn.leaky_relu(h, 0.2)) if self.features else nn.relu
    bn = lambda name: TorchBatchNorm(use_running_average=not train, name=name)
    x = act(bn('bn_z')(conv_transpose(self.conv, z[:, None, None, :], 2 * d, 4, 1, 0, 'convt_z')))
    y = act(bn('bn_y')(conv_transpose(self.conv, y_onehot[:, None, None, :], 2 * d, 4, 1, 0, 'convt_y')))
    x = jnp.concatenate([x, y], -1)
    x = act(bn('bn2')(conv_transpose(self.conv, x, 2 * d, 4, 2, 1, 'convt2')))
    if self.features:
      return nn.relu(conv_transpose(self.conv, x, self.channels, 4, 2, 1, 'convt4'))
    x = act(bn('bn3')(conv_transpose(self.conv, x, d, 4, 2, 1, 'convt3')))
    return jnp.tanh(conv_transpose(self.conv, x, self.channels, 4, 2, 1, 'convt4'))


class DCGANDiscriminator(nn.Module):
  """D(x [B, 32, 32, c], y_onehot [B, C]) -> P(real) [B]; on 16x16 feature maps (D-F) its last kernel is 2x2."""
  width: int = 128
  conv: str = 'xla'

  @nn.compact
  def __call__(self, x: jnp.ndarray, y_onehot: jnp.ndarray, train: bool) -> jnp.ndarray:
    d = self.width
    conv = conv_factory(self.conv)
    down = lambda features, name: conv(features, (4, 4), strides=(2, 2), padding=[(1, 1)] * 2, name=name)
    planes = jnp.broadcast_to(y_onehot[:, None, None, :], x.shape[:3] + y_onehot.shape[-1:])
    h = jnp.concatenate([nn.leaky_relu(down(d // 2, 'conv_x')(x), 0.2),
                         nn.leaky_relu(down(d // 2, 'conv_y')(planes), 0.2)], -1)
    h = nn.leaky_relu(TorchBatchNorm(use_running_average=not train, name='bn2')(down(2 * d, 'conv2')(h)), 0.2)
    h = nn.leaky_relu(TorchBatchNorm(use_running_average=not train, name='bn3')(down(4 * d, 'conv3')(h)), 0.2)
    h = conv(1, (h.shape[1],) * 2, padding='VALID', name='conv4')(h)
    return nn.sigmoid(h.reshape(h.shape[0]))


def normal_init(params, key: jax.Array, std: float = 0.02):
  """Conv and ConvT kernels redrawn from N(0, std^2), their biases zero (the code's `normal_init`); BatchNorm
  keeps scale 1 and bias 0."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  out = []
  for i, (path, leaf) in enumerate(leaves):
    names = [getattr(p, 'key', '') for p in path]
    if names[-1] == 'kernel':
      leaf = std * jax.random.normal(jax.random.fold_in(key, i), leaf.shape, leaf.dtype)
    elif names[-1] == 'bias' and not names[-2].startswith('bn'):
      leaf = jnp.zeros_like(leaf)
    out.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, out)


def dcgan_losses(g_apply, d_apply, num_classes: int):
  """(d_loss, g_loss) of one batch, each (params, stats, ...) -> (loss, new stats): Eq. of App. C-A1 with mean
  BCE; d_loss(d_params, d_stats, g_vars, x, y, key) trains D on the real batch and a G batch of uniform labels;
  g_loss(g_params, g_stats, d_vars, batch_size, key) trains G through D."""
  onehot = lambda y: jax.nn.one_hot(y, num_classes)

  def fake(g_vars, n, key):
    z_key, y_key = jax.random.split(key)
    y = uniform_labels(y_key, n, num_classes)
    images, g_state = g_apply(g_vars, jax.random.normal(z_key, (n, NOISE_DIM)), onehot(y), True,
                              mutable=['batch_stats'])
    return images, y, g_state['batch_stats']

  def d_loss(d_params, d_stats, g_vars, x, y, key, mask=None):
    with batch_rows(mask):  # a partial batch of m real rows meets m generated ones, as in the code
      images, y_fake, g_stats = fake(g_vars, x.shape[0], key)
      images = jax.lax.stop_gradient(images)
      p_real, s = d_apply({'params': d_params, 'batch_stats': d_stats}, x, onehot(y), True,
                          mutable=['batch_stats'])
      p_fake, s = d_apply({'params': d_params, **s}, images, onehot(y_fake), True, mutable=['batch_stats'])
    return bce(p_real, 1.0, mask) + bce(p_fake, 0.0, mask), (s['batch_stats'], g_stats)

  def g_loss(g_params, g_stats, d_vars, n, key, mask=None):
    with batch_rows(mask):
      images, y_fake, g_stats = fake({'params': g_params, 'batch_stats': g_stats}, n, key)
      p_fake, s = d_apply(d_vars, images, onehot(y_fake), True, mutable=['batch_stats'])
    return bce(p_fake, 1.0, mask), (s['batch_stats'], g_stats)
  return d_loss, g_loss


def dcgan(num_classes: int, channels: int = 1, g_width: int = 128, d_width: int = 128, learning_rate: float = 2e-4,
          conv: str = 'xla', size: int = 32) -> ConditionalGenerator:
  """The conditional DCGAN as a `ConditionalGenerator` of size x size outputs (32: images in [-1, 1]; 16: GeFL-F's
  DCGAN-F on feature maps, emitted >= 0 like its ReLU features and never range-mapped); variables {'G': ...,
  'D': ...}, loss = D's + G's."""
  if size not in (16, 32):
    raise ValueError(f'DCGAN emits 32x32 images or 16x16 feature maps, not {size}x{size}.')
  g, d = DCGANGenerator(g_width, channels, conv, features=size == 16), DCGANDiscriminator(d_width, conv)
  optimizer = torch_adam(learning_rate, 0.5, 0.999)
  d_loss, g_loss = dcgan_losses(g.apply, d.apply, num_classes)

  def init(key):
    g_key, d_key = jax.random.split(key)
    one = jnp.zeros((1, num_classes))
    g_vars = g.init(g_key, jnp.zeros((1, NOISE_DIM)), one, False)
    d_vars = d.init(d_key, jnp.zeros((1, size, size, channels)), one, False)
    return {'G': {**g_vars, 'params': normal_init(g_vars['params'], g_key)},
            'D': {**d_vars, 'params': normal_init(d_vars['params'], d_key)}}

  def init_optimizer(variables):
    return {'G': optimizer.init(variables['G']['params']), 'D': optimizer.init(variables['D']['params'])}

  def step(variables, opt_state, x, y, key, lr_scale=1.0, mask=None):
    d_key, g_key = jax.random.split(key)
    G, D = variables['G'], variables['D']
    (ld, (d_stats, g_stats)), grads = jax.value_and_grad(d_loss, has_aux=True)(
        D['params'], D['batch_stats'], G, x, y, d_key, mask)
    d_params, d_opt = step_at_rate(optimizer, D['params'], grads, opt_state['D'], learning_rate * lr_scale)
    D = {'params': d_params, 'batch_stats': d_stats}
    G = {**G, 'batch_stats': g_stats}
    (lg, (d_stats, g_stats)), grads = jax.value_and_grad(g_loss, has_aux=True)(
        G['params'], G['batch_stats'], D, x.shape[0], g_key, mask)
    g_params, g_opt = step_at_rate(optimizer, G['params'], grads, opt_state['G'], learning_rate * lr_scale)
    return ({'G': {'params': g_params, 'batch_stats': g_stats}, 'D': {**D, 'batch_stats': d_stats}},
            {'G': g_opt, 'D': d_opt}, ld + lg)

  def sample(variables, labels, key):
    z = jax.random.normal(key, (labels.shape[0], NOISE_DIM))
    return g.apply(variables['G'], z, jax.nn.one_hot(labels, num_classes), False)

  return ConditionalGenerator('dcgan', init, init_optimizer, step, sample, unit_range=False)
