"""Privacy measurements of what a method shares: GeFL's memorisation ratio of a generator
("GeFL: Model-Agnostic Federated Learning with Generative Models", Eq. 1), and GeFL-F's synthetic images for it.

MND ratio (`mnd_ratio`): for training points x_i, rho_i = min_{v in V} d(x_i, v) / min_{s in S} d(x_i, s), V held-out
(validation) images and S generated ones; the reported number is the mean of rho_i. rho > 1 means the generator's
samples lie closer to the training points than unseen real images do (memorisation); the paper's text states the
ratio the other way round, Eq. 1 and its "> 1 = memorisation" reading agree and are followed.
Distances d (`DISTANCES`): 'pixel', the L2 distance of the images; 'feature', the L2 distance of the
flattened feature maps of a fixed, randomly initialised small_cnn extractor (seed 0, the same for every run: a
label-free perceptual proxy). The paper's LPIPS (AlexNet) needs weights that are not available offline and is not
offered; values under these distances differ from LPIPS values and are labelled with their distance.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import GroupSpec
from fedjax_het.errors import ConfigError
from fedjax_het.evaluation.attack import InversionConfig, invert
from fedjax_het.methods.gefl_f import GeFLFConfig, apply_features, feature_generator, features_module

DISTANCES = ('pixel', 'feature')


def nearest_distances(queries: jnp.ndarray, candidates: jnp.ndarray, chunk: int = 256) -> jnp.ndarray:
  """min over candidates [M, D] of the L2 distance to each query [N, D] -> [N], `chunk` queries at a time."""
  sq = jnp.sum(candidates ** 2, -1)

  def block(q):
    d2 = jnp.sum(q ** 2, -1)[:, None] - 2 * q @ candidates.T + sq[None, :]
    return jnp.sqrt(jnp.maximum(jnp.min(d2, -1), 0.0))
  n = queries.shape[0]
  pad = (-n) % chunk
  padded = jnp.pad(queries, [(0, pad), (0, 0)]).reshape(-1, chunk, queries.shape[-1])
  return jax.lax.map(block, padded).reshape(-1)[:n]


def mnd_ratio(train: jnp.ndarray, validation: jnp.ndarray, synthetic: jnp.ndarray,
              embed: Callable[[jnp.ndarray], jnp.ndarray] = lambda x: x) -> tuple[float, np.ndarray]:
  """(mean rho, rho per training point) of Eq. 1 with d = L2 between embed(.) of the points, each a batch
  [N, ...] flattened after embedding."""
  flat = lambda x: jnp.reshape(embed(jnp.asarray(x, jnp.float32)), (len(x), -1))
  t, v, s = flat(train), flat(validation), flat(synthetic)
  rho = nearest_distances(t, v) / jnp.maximum(nearest_distances(t, s), 1e-12)
  return float(jnp.mean(rho)), np.asarray(rho)


def embedding(distance: str, input_shape: tuple[int, ...]) -> Callable[[jnp.ndarray], jnp.ndarray]:
  """The map whose outputs the L2 distance compares: identity ('pixel') or a fixed random small_cnn extractor
  ('feature'), chunked so that large sets fit in memory."""
  if distance == 'pixel':
    return lambda x: x
  if distance != 'feature':
    raise ConfigError(f'--distance={distance!r}: choose from {", ".join(DISTANCES)} (LPIPS needs weights that '
                      f'are not available offline).')
  from fedjax_het.models.init import init_variables
  from fedjax_het.models.registry import build_model
  model = build_model('small_cnn', 10, 64)
  variables = jax.jit(lambda k: init_variables(model, k, jnp.zeros((1,) + tuple(input_shape)), False))(
      jax.random.PRNGKey(0))  # one program (eagerly, an op per layer)
  features = jax.jit(lambda x: model.apply(variables, x, False, method=lambda m, x, t: m.extractor(x, train=t)))
  return lambda x: jnp.concatenate([features(x[i:i + 256]).reshape(len(x[i:i + 256]), -1)
                                    for i in range(0, len(x), 256)])


def gefl_f_synthetic_images(cfg: GeFLFConfig, num_classes: int, group: GroupSpec, server: dict, key: jax.Array,
                            n: int, inversion: InversionConfig) -> jnp.ndarray:
  """GeFL-F's synthetic set S for the MND ratio (GeFL paper, Sec. VI, Table VI): n feature
  maps per class from the server's feature generator, each inverted into an image through the frozen, white-box F
  (`attack.invert` with `inversion`, an InversionConfig: Adam on x minimising ||F(x) - f||^2 / ||f||^2
  + TV; the paper's inversion method [52] is unspecified). Returns images [C * n, H, W, c] in [-1, 1]."""
  sample_key, invert_key = jax.random.split(key)
  labels = jnp.repeat(jnp.arange(num_classes), n)
  maps = feature_generator(cfg, num_classes, group).sample(server.generator, labels, sample_key)
  module = features_module(group)
  rep = lambda x: apply_features(module, server.fe, x).reshape(x.shape[0], -1)
  images, _ = jax.jit(lambda t: invert(rep, t, tuple(group.input_shape), inversion, invert_key))(
      maps.reshape(maps.shape[0], -1))
  return images
