"""How much an inverted image leaks of the client's images.

Leakage, PSNR and MSE on the 0-255 scale (images mapped (x + 1) / 2 * 255, as the paper reports), measured three
ways so that an uninformative image cannot win:
  reference (`reference_images`): against the one image the upload describes, fixed before the attack: for a
    representation its own sample; for a prototype of class c the mean image of the client's class-c samples; for
    an entangled representation sum_c w_c (mean image of class c), the weights w_c its soft label reveals (Eq. 2:
    the same weights that mix the class prototypes);
  best match (`leakage`, the attacker-favourable measure): against the most similar (lowest MSE) original the upload
    could have come from (`candidate_mask`: the sample; any sample of the class; any sample of the client). On
    MNIST this favours any blob: a black image finds some dark digit among hundreds;
  null baseline (`NULL_IMAGE`, all black, the digits' background): the same two scores of an image that knows
    nothing; the table reports each score's gain over it, the leakage a null image cannot win;
  identification (`identified`): whether a reconstruction is nearer (MSE) to its own reference than to every other
    target's reference of the same run (chance: 1 / targets).
PSNR is capped at `PSNR_MAX` dB (an exact reconstruction). SSIM (`ssim_255`, DeepMind's dm-pix) is reported
against the reference beside PSNR and MSE.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_het.errors import ConfigError
from fedjax_het.methods.shared.common import class_prototypes

PSNR_MAX = 100.0  # dB, reported for an exact reconstruction (MSE 0)
NULL_IMAGE = -1.0  # the null reconstruction: every pixel black (0 on the 0-255 scale)


KINDS = ('representation', 'prototype', 'entangled')


# ---------------------------------------------------------------------------------------------------- metrics
def to_255(x: jnp.ndarray) -> jnp.ndarray:
  """Images in [-1, 1] on the paper's 0-255 scale: (x + 1) / 2 * 255."""
  return (jnp.asarray(x, jnp.float32) + 1.0) * 127.5


def mse_255(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """Per-image mean squared error on the 0-255 scale of images a, b [..., H, W, C] in [-1, 1] -> [...]
  (the paper's MSE, Sec. 4 'Evaluation Metrics')."""
  return jnp.mean((to_255(a) - to_255(b)) ** 2, axis=(-3, -2, -1))


def psnr_from_mse(mse: jnp.ndarray) -> jnp.ndarray:
  """PSNR = 10 log10(255^2 / MSE) in dB (the paper's ref. [29]), capped at `PSNR_MAX` (MSE 0)."""
  floor = 255.0 ** 2 * 10.0 ** (-PSNR_MAX / 10.0)
  return 10.0 * jnp.log10(255.0 ** 2 / jnp.maximum(mse, floor))


def ssim_255(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """Per-image SSIM (Wang et al. 2004; dm-pix: an 11 x 11 Gaussian window of sigma 1.5, k1 0.01, k2 0.03, L = 255)
  of images a, b [..., H, W, C] in [-1, 1] on the 0-255 scale -> [...]; on images smaller than 11 pixels the
  window is the largest odd size that fits (7 on 8 x 8 digits)."""
  import dm_pix
  a, b = jnp.broadcast_arrays(to_255(a), to_255(b))
  size = min(11, a.shape[-3] - (1 - a.shape[-3] % 2), a.shape[-2] - (1 - a.shape[-2] % 2))
  return dm_pix.ssim(a, b, max_val=255.0, filter_size=size)


def psnr_255(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """Per-image PSNR on the 0-255 scale of images a, b [..., H, W, C] in [-1, 1] -> [...]."""
  return psnr_from_mse(mse_255(a, b))


def candidate_mask(kind: str, y: jnp.ndarray, valid: jnp.ndarray, rows: jnp.ndarray, labels: jnp.ndarray
                   ) -> jnp.ndarray:
  """Which of a client's training rows [N] each target [T] could have come from -> bool [T, N] (module docstring).

  kind 'representation': row rows[t] only; 'prototype': the valid rows of class labels[t]; 'entangled': every
  valid row. y [N]: the rows' labels; valid [N]: the real rows.
  """
  valid = jnp.asarray(valid, bool)
  n = y.shape[0]
  if kind == 'representation':
    return (jnp.arange(n)[None, :] == jnp.asarray(rows)[:, None]) & valid[None, :]
  if kind == 'prototype':
    return (jnp.asarray(y)[None, :] == jnp.asarray(labels)[:, None]) & valid[None, :]
  if kind == 'entangled':
    return jnp.broadcast_to(valid[None, :], (len(labels), n))
  raise ConfigError(f'upload kind {kind!r} is unknown; choose one of {", ".join(KINDS)}.')


def leakage(reconstructions: jnp.ndarray, originals: jnp.ndarray, allowed: jnp.ndarray) -> dict:
  """PSNR and MSE (0-255 scale) of each reconstruction [T, H, W, C] against its best-matching original among the
  rows `allowed` [T, N] of originals [N, H, W, C] (lowest MSE; the attacker-favourable measure of Q2).

  Returns {'psnr': [T], 'mse': [T], 'match': [T] index of the matched original}; a target with no allowed row
  gets MSE inf, PSNR -inf and match -1.
  """
  mse = jax.vmap(lambda r: mse_255(r[None], originals))(jnp.asarray(reconstructions, jnp.float32))  # [T, N]
  mse = jnp.where(allowed, mse, jnp.inf)
  match = jnp.argmin(mse, axis=1)
  best = jnp.take_along_axis(mse, match[:, None], axis=1)[:, 0]
  has = jnp.any(allowed, axis=1)
  return {'psnr': jnp.where(has, psnr_from_mse(best), -jnp.inf), 'mse': best, 'match': jnp.where(has, match, -1)}


def class_mean_images(x: jnp.ndarray, y: jnp.ndarray, valid: jnp.ndarray, num_classes: int) -> jnp.ndarray:
  """The mean image of each class over a client's valid rows: [C, H, W, c] (zeros for classes it lacks)."""
  x = jnp.asarray(x, jnp.float32)
  means, _ = class_prototypes(x.reshape(x.shape[0], -1), jnp.asarray(y), jnp.asarray(valid, bool), num_classes)
  return means.reshape((num_classes,) + x.shape[1:])


def reference_images(kind: str, weights: jnp.ndarray, rows: jnp.ndarray, x: jnp.ndarray, y: jnp.ndarray,
                     valid: jnp.ndarray) -> jnp.ndarray:
  """The image each target [T] describes (module docstring), [T, H, W, c]: a representation's own sample x[row];
  otherwise sum_c weights[t, c] (mean image of class c), weights [T, C] the target's class weights (one-hot for a
  prototype, the soft label of an entangled representation)."""
  if kind == 'representation':
    return jnp.asarray(x)[jnp.asarray(rows)]
  if kind not in KINDS:
    raise ConfigError(f'upload kind {kind!r} is unknown; choose one of {", ".join(KINDS)}.')
  means = class_mean_images(x, y, valid, weights.shape[-1])
  return jnp.tensordot(jnp.asarray(weights, jnp.float32), means, axes=(1, 0))


def identified(reconstructions: jnp.ndarray, references: jnp.ndarray) -> jnp.ndarray:
  """bool [T]: reconstruction t is nearer (MSE) to reference t than to every other reference (ties count as
  misses); the rate's chance level is 1 / T."""
  mse = jax.vmap(lambda r: mse_255(r[None], references))(jnp.asarray(reconstructions, jnp.float32))  # [T, T]
  own = jnp.diagonal(mse)
  others = jnp.where(jnp.eye(mse.shape[0], dtype=bool), jnp.inf, mse)
  return own < others.min(axis=1)
