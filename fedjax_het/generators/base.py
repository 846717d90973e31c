"""The interface of a class-conditional image generator trained by federated clients (GeFL's DCGAN, CVAE, DDPM).

A `ConditionalGenerator` is pure functions over a pytree of variables, so a client can hold one in its
`ClientState.extra`, train it inside a jitted, vmapped local loop and upload it for averaging:

  init(key) -> variables                     every client and the server start from the same draw (shared key)
  init_optimizer(variables) -> opt_state     per-client optimizer state(s), kept across rounds by GeFL
  step(variables, opt_state, x, y, key, lr_scale, mask) -> (variables, opt_state, loss)
                                             one update on a batch of real images x [B, H, W, C] in the
                                             generator's own range and labels y [B]; lr_scale multiplies the
                                             learning rate (DDPM's linear decay over rounds); mask [B] (or None):
                                             the real rows of a padded partial batch, the only ones its losses
                                             and BatchNorm statistics count
  sample(variables, labels, key) -> images   one image per label, in the generator's own range, eval mode
  unit_range: True when the generator trains on and emits [0, 1] images (CVAE, DDPM: GeFL's code feeds them
    ToTensor images), False for [-1, 1] (DCGAN's tanh). `to_generator_range` / `from_generator_range` convert.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.rows import batch_mean, row_weights


class ConditionalGenerator(NamedTuple):
  """A class-conditional generator as pure functions (see the module docstring)."""
  name: str
  init: Callable[[jax.Array], Any]
  init_optimizer: Callable[[Any], Any]
  step: Callable[..., tuple[Any, Any, jnp.ndarray]]
  sample: Callable[[Any, jnp.ndarray, jax.Array], jnp.ndarray]
  unit_range: bool


def to_generator_range(x: jnp.ndarray, unit_range: bool) -> jnp.ndarray:
  """Images in [-1, 1] (the library's normalisation) mapped to a generator's range ([0, 1] if unit_range)."""
  return (x + 1.0) / 2.0 if unit_range else x


def from_generator_range(x: jnp.ndarray, unit_range: bool) -> jnp.ndarray:
  """A generator's images mapped back to [-1, 1] (from [0, 1] if unit_range)."""
  return 2.0 * x - 1.0 if unit_range else x


def bce(p: jnp.ndarray, target: float, mask: jnp.ndarray | None = None) -> jnp.ndarray:
  """torch.nn.BCELoss (mean) of probabilities p [B, ...] against a constant target, logs clamped at -100 as
  PyTorch clamps them; over the rows where mask [B] is True when given (a padded partial batch)."""
  log_p, log_q = jnp.maximum(jnp.log(p), -100.0), jnp.maximum(jnp.log1p(-p), -100.0)
  return -batch_mean(target * log_p + (1.0 - target) * log_q, mask)


def uniform_labels(key: jax.Array, n: int, num_classes: int) -> jnp.ndarray:
  """n labels drawn uniformly over all classes (GeFL samples y' this way, not from a client's label mix)."""
  return jax.random.randint(key, (n,), 0, num_classes)


def gaussian_kl(mu: jnp.ndarray, logvar: jnp.ndarray, mask: jnp.ndarray | None = None) -> jnp.ndarray:
  """KL(N(mu, exp(logvar)) || N(0, I)) summed over every entry: -0.5 sum(1 + logvar - mu^2 - exp(logvar)) (the VAE
  term of GeFL's CVAE and Velo's server CVAE); over the rows where mask [B] is True when given."""
  terms = 1.0 + logvar - mu ** 2 - jnp.exp(logvar)
  return -0.5 * jnp.sum(terms * row_weights(mask, terms))
