"""GeFL's conditional DDPM with classifier-free guidance ("GeFL: Model-Agnostic Federated Learning with Generative
Models", App. C-A3; the conditional diffusion of TeaPearce's MNIST example that GeFL's code uses), on images in [0, 1].

Schedule (`ddpm_schedule`): beta_t = beta1 + (beta2 - beta1) t / T for t = 0..T (beta1 = 1e-4, beta2 = 0.02),
alpha_t = 1 - beta_t, alphabar_t = prod_{s=0..t} alpha_s (the product includes the s = 0 factor, as the code).
Training: t ~ U{1..T}, x_t = sqrt(alphabar_t) x0 + sqrt(1 - alphabar_t) eps, loss = mean (eps - eps_theta(x_t, c,
t / T))^2 with the class context dropped (zeroed) with probability 0.1. Sampling (a `lax.fori_loop` on device):
x_T ~ N(0, I); for i = T..1, eps = (1 + w) eps_theta(x_i, c) - w eps_theta(x_i, none) and x_{i-1} = (x_i - eps
(1 - alpha_i) / sqrt(1 - alphabar_i)) / sqrt(alpha_i) + sqrt(beta_i) z, z ~ N(0, I) except z = 0 at i = 1. With
w = 0 the unconditional pass is skipped (it has weight 0). Adam(1e-4); GeFL decays its rate linearly over the
knowledge-aggregation rounds (the `lr_scale` of a step).

The U-Net (`ContextUnet`, width n): init = residual ResBlock(c -> n); down1 = ResBlock(n, n) + MaxPool 2; down2 =
ResBlock(n, 2n) + MaxPool 2; to_vec = AvgPool(S / 4) + GELU; time embeddings EmbedFC(1 -> 2n), (1 -> n) and class
embeddings EmbedFC(C -> 2n), (C -> n) (Linear, GELU, Linear); up0 = ConvT(2n, 2n, S/4, S/4) GroupNorm(8) ReLU;
up1 = UnetUp(4n -> n) on (cemb1 * up0 + temb1, down2); up2 = UnetUp(2n -> n) on (cemb2 * up1 + temb2, down1); out
= Conv(2n, n, 3, 1, 1) GroupNorm(8) ReLU Conv(n, c, 3, 1, 1) on (up2, init). ResBlock = 2 x [Conv3x3 BN GELU];
only init is residual ((x1 + x2) / 1.414); UnetUp = ConvT(in, out, 2, 2) then two ResBlocks on (x, skip). For S =
32, n = 128, c = 1: 7,568,641 parameters (Table V); S = 16, c = 3 (DDPM-F): 4,427,523 (Table VI). GELU is exact
(PyTorch's default). The code multiplies a kept one-hot context by -1; here it stays +1 (a sign the first Linear
absorbs).
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedjax_het.generators.base import ConditionalGenerator
from fedjax_het.models.conv import conv_factory, conv_transpose
from fedjax_het.models.init import torch_default_init
from fedjax_het.models.layers import Dense
from fedjax_het.models.norm import TorchBatchNorm, batch_rows
from fedjax_het.optim import step_at_rate, torch_adam
from fedjax_het.rows import batch_mean

gelu = lambda x: nn.gelu(x, approximate=False)


class Schedule(NamedTuple):
  """The DDPM schedule's arrays, each [T + 1], indexed by t = 0..T."""
  beta: jnp.ndarray
  alpha: jnp.ndarray
  alphabar: jnp.ndarray


def ddpm_schedule(steps: int, beta1: float = 1e-4, beta2: float = 0.02) -> Schedule:
  """beta_t = beta1 + (beta2 - beta1) t / T, alpha_t = 1 - beta_t, alphabar_t = prod_{s <= t} alpha_s, t = 0..T."""
  beta = beta1 + (beta2 - beta1) * jnp.arange(steps + 1, dtype=jnp.float32) / steps
  alpha = 1.0 - beta
  return Schedule(beta, alpha, jnp.exp(jnp.cumsum(jnp.log(alpha))))


def reverse_step(schedule: Schedule, i, x: jnp.ndarray, eps: jnp.ndarray, z: jnp.ndarray) -> jnp.ndarray:
  """x_{i-1} = (x_i - eps (1 - alpha_i) / sqrt(1 - alphabar_i)) / sqrt(alpha_i) + sqrt(beta_i) z."""
  coef = (1.0 - schedule.alpha[i]) / jnp.sqrt(1.0 - schedule.alphabar[i])
  return (x - eps * coef) / jnp.sqrt(schedule.alpha[i]) + jnp.sqrt(schedule.beta[i]) * z


def guided(eps_cond: jnp.ndarray, eps_uncond: jnp.ndarray, w: float) -> jnp.ndarray:
  """Classifier-free guidance: (1 + w) eps_cond - w eps_uncond."""
  return (1.0 + w) * eps_cond - w * eps_uncond


class ResBlock(nn.Module):
  """2 x [Conv3x3 BN GELU]; residual: (x + x2 if the widths match else x1 + x2) / 1.414."""
  features: int
  residual: bool = False
  conv: str = 'xla'

  @nn.compact
  def __call__(self, x, train: bool):
    conv = lambda name: conv_factory(self.conv)(self.features, (3, 3), padding=[(1, 1)] * 2, name=name)
    x1 = gelu(TorchBatchNorm(use_running_average=not train, name='bn1')(conv('conv1')(x)))
    x2 = gelu(TorchBatchNorm(use_running_average=not train, name='bn2')(conv('conv2')(x1)))
    if not self.residual:
      return x2
    return ((x if x.shape[-1] == self.features else x1) + x2) / 1.414


class EmbedFC(nn.Module):
  """Linear, GELU, Linear."""
  features: int

  @nn.compact
  def __call__(self, x):
    return Dense(self.features, name='fc2')(gelu(Dense(self.features, name='fc1')(x)))


class UnetUp(nn.Module):
  """ConvT(in, out, 2, 2) on (x, skip) concatenated, then two ResBlocks."""
  features: int
  conv: str = 'xla'

  @nn.compact
  def __call__(self, x, skip, train: bool):
    x = conv_transpose(self.conv, jnp.concatenate([x, skip], -1), self.features, 2, 2, 0, 'convt')
    x = ResBlock(self.features, conv=self.conv, name='res1')(x, train)
    return ResBlock(self.features, conv=self.conv, name='res2')(x, train)


class ContextUnet(nn.Module):
  """eps_theta(x [B, S, S, c], context [B, C] (one-hot, zeros when dropped), t [B] in (0, 1]) -> [B, S, S, c]."""
  channels: int = 1
  width: int = 128
  conv: str = 'xla'

  @nn.compact
  def __call__(self, x, context, t, train: bool):
    n, size = self.width, x.shape[1]
    x0 = ResBlock(n, residual=True, conv=self.conv, name='init')(x, train)
    pool = lambda h: nn.max_pool(h, (2, 2), (2, 2))
    d1 = pool(ResBlock(n, conv=self.conv, name='down1')(x0, train))
    d2 = pool(ResBlock(2 * n, conv=self.conv, name='down2')(d1, train))
    hidden = gelu(nn.avg_pool(d2, (size // 4, size // 4), (size // 4, size // 4)))
    t = t[:, None]
    cemb1 = EmbedFC(2 * n, name='context1')(context)[:, None, None, :]
    temb1 = EmbedFC(2 * n, name='time1')(t)[:, None, None, :]
    cemb2 = EmbedFC(n, name='context2')(context)[:, None, None, :]
    temb2 = EmbedFC(n, name='time2')(t)[:, None, None, :]
    u = conv_transpose(self.conv, hidden, 2 * n, size // 4, size // 4, 0, 'convt_up0')
    u = nn.relu(nn.GroupNorm(8, epsilon=1e-5, name='gn_up0')(u))
    u = UnetUp(n, self.conv, name='up1')(cemb1 * u + temb1, d2, train)
    u = UnetUp(n, self.conv, name='up2')(cemb2 * u + temb2, d1, train)
    out = conv_factory(self.conv)(n, (3, 3), padding=[(1, 1)] * 2, name='out1')(jnp.concatenate([u, x0], -1))
    out = nn.relu(nn.GroupNorm(8, epsilon=1e-5, name='gn_out')(out))
    return conv_factory(self.conv)(self.channels, (3, 3), padding=[(1, 1)] * 2, name='out2')(out)


def ddpm(num_classes: int, channels: int = 1, size: int = 32, width: int = 128, steps: int = 100,
         guidance: float = 0.0, drop_prob: float = 0.1, learning_rate: float = 1e-4, conv: str = 'xla'
         ) -> ConditionalGenerator:
  """GeFL's DDPM as a `ConditionalGenerator` (variables of `ContextUnet`), T = `steps`, guidance weight w."""
  net = ContextUnet(channels, width, conv)
  schedule = ddpm_schedule(steps)
  optimizer = torch_adam(learning_rate)

  def init(key):
    variables = net.init(key, jnp.zeros((1, size, size, channels)), jnp.zeros((1, num_classes)), jnp.zeros(1),
                         False)
    return {**variables, 'params': torch_default_init(variables['params'], jax.random.fold_in(key, 1))}

  def step(variables, opt_state, x, y, key, lr_scale=1.0, mask=None):
    t_key, n_key, m_key = jax.random.split(key, 3)
    t = jax.random.randint(t_key, (x.shape[0],), 1, steps + 1)
    noise = jax.random.normal(n_key, x.shape)
    ab = schedule.alphabar[t][:, None, None, None]
    x_t = jnp.sqrt(ab) * x + jnp.sqrt(1.0 - ab) * noise
    keep = 1.0 - jax.random.bernoulli(m_key, drop_prob, (x.shape[0],)).astype(x.dtype)
    context = jax.nn.one_hot(y, num_classes) * keep[:, None]

    def loss(params):
      with batch_rows(mask):
        eps, state = net.apply({**variables, 'params': params}, x_t, context, t / steps, True,
                               mutable=['batch_stats'])
      return batch_mean((noise - eps) ** 2, mask), state['batch_stats']
    (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(variables['params'])
    params, opt_state = step_at_rate(optimizer, variables['params'], grads, opt_state, learning_rate * lr_scale)
    return {'params': params, 'batch_stats': stats}, opt_state, value

  def sample(variables, labels, key):
    n = labels.shape[0]
    context = jax.nn.one_hot(labels, num_classes)
    init_key, loop_key = jax.random.split(key)

    def body(j, x):
      i = steps - j
      t = jnp.full((n,), i / steps)
      eps = net.apply(variables, x, context, t, False)
      if guidance:
        eps = guided(eps, net.apply(variables, x, jnp.zeros_like(context), t, False), guidance)
      z = jnp.where(i > 1, jax.random.normal(jax.random.fold_in(loop_key, i), x.shape), 0.0)
      return reverse_step(schedule, i, x, eps, z)
    x = jax.random.normal(init_key, (n, size, size, channels))
    return jax.lax.fori_loop(0, steps, body, x)

  return ConditionalGenerator('ddpm', init, lambda v: optimizer.init(v['params']), step, sample, unit_range=True)
