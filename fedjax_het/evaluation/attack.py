"""The inversion attack: representation inversion: how much of a client's images an attacker recovers from what a method uploads
("FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated Learning",
Sec. 4, Q2, Figure 4 and Appendix C.1; the attack of its ref. [35], deep image prior).

Threat model (the paper's): the attacker holds the client's extractor, RM(g(.)) in eval mode (white box), and one
uploaded d-vector t. It optimises an image x from noise so that RM(g(x)) matches t (`invert`):

    min_x  ||RM(g(x)) - t||^2 / ||t||^2  +  tv_weight * TV(x),     x = tanh(z) in [-1, 1]   ('pixel' prior)
                                                                   x = DIP_theta(noise)     ('dip' prior)

with Adam for `steps` steps. The representation error is divided by ||t||^2 so that one --tv_weight fits every
width d and scale of representation; TV is the mean absolute difference of neighbouring pixels (anisotropic total
variation). The deep-image-prior option (Ulyanov et al. 2018, the paper's ref. [35]) optimises the weights theta of
a small randomly initialised convolutional net whose output, from a fixed noise input, is the image. Targets are
independent problems: one jitted function vmaps the attack over a batch of them, each keyed by its own index, so a
target's reconstruction does not depend on which others share its batch or on padding (`invert_padded`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_het.errors import ConfigError
from fedjax_het.models.layers import Conv

PRIORS = ('pixel', 'dip')


@dataclasses.dataclass(frozen=True)
class InversionConfig:
  """The attack's settings (each a flag of experiments/invert.py, named in its error).

  steps: Adam steps (--inversion_steps); learning_rate: Adam's rate (--inversion_lr); tv_weight: weight of the
  total-variation prior (--tv_weight); prior: 'pixel' (optimise the image through tanh) or 'dip' (optimise a deep
  image prior's weights) (--prior); dip_channels: the DIP net's width (--dip_channels); init_scale: std of the
  initial noise (pixel prior: of z; DIP: of its fixed input).
  """
  steps: int = 500
  learning_rate: float = 0.01
  tv_weight: float = 0.1
  prior: str = 'dip'
  dip_channels: int = 16
  init_scale: float = 0.1

  def __post_init__(self):
    if self.steps < 1:
      raise ConfigError(f'--inversion_steps={self.steps} must be >= 1.')
    if not (np.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f'--inversion_lr={self.learning_rate} must be a finite number > 0.')
    if not (np.isfinite(self.tv_weight) and self.tv_weight >= 0):
      raise ConfigError(f'--tv_weight={self.tv_weight} must be a finite number >= 0.')
    if self.prior not in PRIORS:
      raise ConfigError(f'--prior={self.prior!r} is unknown; choose one of {", ".join(PRIORS)}.')
    if self.dip_channels < 1:
      raise ConfigError(f'--dip_channels={self.dip_channels} must be >= 1.')
    if not self.init_scale > 0:
      raise ConfigError(f'init_scale={self.init_scale} must be > 0.')


def total_variation(x: jnp.ndarray) -> jnp.ndarray:
  """Anisotropic total variation of one image x [H, W, C]: the mean absolute difference of vertically and of
  horizontally neighbouring pixels, summed."""
  return jnp.mean(jnp.abs(x[1:] - x[:-1])) + jnp.mean(jnp.abs(x[:, 1:] - x[:, :-1]))


# ---------------------------------------------------------------------------------------------------- attack
class DeepImagePrior(nn.Module):
  """A small conv net (3x3 conv - ReLU twice, then 3x3 conv - tanh) mapping a fixed noise image to an image in
  [-1, 1]: the deep image prior (Ulyanov et al. 2018) whose weights the attack optimises instead of pixels."""
  channels: int
  out_channels: int

  @nn.compact
  def __call__(self, z: jnp.ndarray) -> jnp.ndarray:
    h = nn.relu(Conv(self.channels, (3, 3))(z))
    h = nn.relu(Conv(self.channels, (3, 3))(h))
    return jnp.tanh(Conv(self.out_channels, (3, 3))(h))


def image_parameterisation(image_shape: Sequence[int], cfg: InversionConfig
                           ) -> tuple[Callable[[jax.Array], Any], Callable[[Any], jnp.ndarray]]:
  """(init(key) -> variables, render(variables) -> image [H, W, C] in [-1, 1]) of the prior: 'pixel', z ~
  N(0, init_scale^2) per pixel and x = tanh(z); 'dip', a `DeepImagePrior` and its fixed noise input."""
  shape = tuple(image_shape)
  if cfg.prior == 'pixel':
    return (lambda key: cfg.init_scale * jax.random.normal(key, shape)), jnp.tanh
  net = DeepImagePrior(cfg.dip_channels, shape[-1])

  def init(key):
    noise_key, net_key = jax.random.split(key)
    z = cfg.init_scale * jax.random.normal(noise_key, shape[:-1] + (cfg.dip_channels,))
    return {'z': z, 'theta': net.init(net_key, z[None])['params']}

  def render(v):
    return net.apply({'params': v['theta']}, jax.lax.stop_gradient(v['z'])[None])[0]
  return init, render


def inversion_loss(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], image: jnp.ndarray, target: jnp.ndarray,
                   tv_weight: float) -> jnp.ndarray:
  """||rep_fn(x) - t||^2 / ||t||^2 + tv_weight * TV(x) for one image x [H, W, C] and target t [d]; rep_fn maps a
  batch [B, H, W, C] to [B, d]."""
  rep = rep_fn(image[None])[0]
  scale = jnp.maximum(jnp.sum(target ** 2), 1e-12)
  return jnp.sum((rep - target) ** 2) / scale + tv_weight * total_variation(image)


def invert_one(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], target: jnp.ndarray, image_shape: Sequence[int],
               cfg: InversionConfig, key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The attack on one target [d] (module docstring): (image [H, W, C] in [-1, 1], its final representation loss
  ||rep(x) - t||^2 / ||t||^2). Adam over cfg.steps steps in a lax.scan; pure, so it jits and vmaps."""
  init, render = image_parameterisation(image_shape, cfg)
  opt = optax.adam(cfg.learning_rate)
  variables = init(key)
  loss = lambda v: inversion_loss(rep_fn, render(v), target, cfg.tv_weight)

  def step(carry, _):
    v, state = carry
    grads = jax.grad(loss)(v)
    updates, state = opt.update(grads, state, v)
    return (optax.apply_updates(v, updates), state), None

  (variables, _), _ = jax.lax.scan(step, (variables, opt.init(variables)), None, length=cfg.steps)
  image = render(variables)
  return image, inversion_loss(rep_fn, image, target, 0.0)


def target_keys(key: jax.Array, index: jnp.ndarray) -> jax.Array:
  """Each target's key, fold_in(key, its index): a target's noise does not depend on its batch."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


def invert(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], targets: jnp.ndarray, image_shape: Sequence[int],
           cfg: InversionConfig, key: jax.Array, index: Optional[jnp.ndarray] = None
           ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The attack vmapped over targets [T, d] (call it under jax.jit, or use `invert_padded`): (images [T, H, W, C],
  final representation losses [T]). Target t uses key fold_in(key, index[t]) (default index t)."""
  index = jnp.arange(targets.shape[0]) if index is None else jnp.asarray(index)
  return jax.vmap(lambda t, k: invert_one(rep_fn, t, image_shape, cfg, k))(targets, target_keys(key, index))


def invert_padded(run: Callable[[jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]], targets: np.ndarray,
                  batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
  """`run(targets [batch, d], index [batch])` (a jitted `invert`, e.g. of `inverter`) over any number of targets
  [T, d] in batches of `batch` rows, the last padded with copies of the first row (masked: cut back after), so one
  compiled function serves every T. Returns (images [T, H, W, C], representation losses [T]) as numpy."""
  targets = np.asarray(targets, np.float32)
  if batch < 1:
    raise ConfigError(f'--inversion_batch={batch} must be >= 1.')
  n = targets.shape[0]
  if n == 0:
    raise ConfigError('the upload holds no vectors to invert (a client without training rows?); choose other '
                      '--attack_clients.')
  pad = (-n) % batch
  padded = np.concatenate([targets, np.repeat(targets[:1], pad, 0)])
  images, losses = [], []
  for s in range(0, n + pad, batch):
    im, lo = run(jnp.asarray(padded[s:s + batch]), jnp.arange(s, s + batch))
    images.append(np.asarray(im))
    losses.append(np.asarray(lo))
  return np.concatenate(images)[:n], np.concatenate(losses)[:n]


def inverter(model: Any, image_shape: Sequence[int], cfg: InversionConfig) -> Callable:
  """The attack through a classifier's eval-mode extractor, jitted once per architecture:
  run(params, model_state, key, targets [B, d], index [B]) -> (images [B, H, W, C], representation losses [B])."""
  def run(params, model_state, key, targets, index):
    return invert(extractor_fn(model, params, model_state), targets, image_shape, cfg, key, index)
  return jax.jit(run)


def extractor_fn(model: Any, params: Any, model_state: Any) -> Callable[[jnp.ndarray], jnp.ndarray]:
  """RM(g(.)) of a client's classifier in eval mode: x [B, H, W, C] -> reps [B, d] (`models.forward`)."""
  from fedjax_het.models.forward import forward
  return lambda x: forward(model, params, model_state, x, False)[1]
