"""Data augmentation of a training batch on device, inside the jitted local step: the CIFAR references' random crop
with zero padding and horizontal flip (torchvision's `RandomCrop(32, padding=4)` then `RandomHorizontalFlip()`,
applied to the raw images before `Normalize`, so the padding is black), and FedGKT's loader's Cutout(16) after them
(DeVries and Taylor 2017, "Improved Regularization of Convolutional Neural Networks with Cutout": a 16 x 16 square
around a uniform centre, clipped at the borders, set to 0 after `Normalize`, i.e. to the dataset's mean colour).

Each image draws its own crop offset and flip from the step's key, so the same seed gives the same batches on
every executor (vmap or sequential) and on resume; a run without augmentation draws nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from fedjax_het.errors import ConfigError

AUGMENTATIONS = ('none', 'crop_flip', 'crop_flip_cutout')
CROP_PADDING = 4  # the CIFAR references' RandomCrop(32, padding=4)
CUTOUT_LENGTH = 16  # FedGKT's CIFAR loader: Cutout(16)
_AUGMENT_STREAM = 0x415547  # folded into a step's key: draws that change no other draw of the step


def crop_and_flip(x: jnp.ndarray, rows: jnp.ndarray, cols: jnp.ndarray, flip: jnp.ndarray, pad: int,
                  fill: jnp.ndarray) -> jnp.ndarray:
  """Images x [B, H, W, C], each padded by `pad` pixels of `fill` ([C] or scalar) on every side, cut to the H x W
  window whose top-left corner is (rows[b], cols[b]) of the padded image (0 <= offset <= 2 pad), and mirrored
  left-right where flip[b]."""
  fill = jnp.broadcast_to(jnp.asarray(fill, x.dtype), x.shape[-1:])
  padded = jnp.broadcast_to(fill, (x.shape[0], x.shape[1] + 2 * pad, x.shape[2] + 2 * pad, x.shape[3]))
  padded = padded.at[:, pad:pad + x.shape[1], pad:pad + x.shape[2]].set(x)
  window = lambda img, r, c: jax.lax.dynamic_slice(img, (r, c, 0), x.shape[1:])
  out = jax.vmap(window)(padded, rows, cols)
  return jnp.where(flip[:, None, None, None], out[:, :, ::-1], out)


def random_crop_flip(x: jnp.ndarray, key: jax.Array, pad: int = 4, fill: float | Sequence[float] = -1.0
                     ) -> jnp.ndarray:
  """`crop_and_flip` with each image's offsets uniform in {0, ..., 2 pad} and a flip of probability 1/2, drawn
  from `key` (torchvision's RandomCrop(padding=pad) and RandomHorizontalFlip(0.5))."""
  k_row, k_col, k_flip = jax.random.split(key, 3)
  batch = x.shape[0]
  rows = jax.random.randint(k_row, (batch,), 0, 2 * pad + 1)
  cols = jax.random.randint(k_col, (batch,), 0, 2 * pad + 1)
  flip = jax.random.bernoulli(k_flip, 0.5, (batch,))
  return crop_and_flip(x, rows, cols, flip, pad, jnp.asarray(fill))


def cutout(x: jnp.ndarray, rows: jnp.ndarray, cols: jnp.ndarray, length: int) -> jnp.ndarray:
  """Images x [B, H, W, C] with the pixels (i, j), rows[b] - length // 2 <= i < rows[b] + length // 2 and the same
  for j around cols[b], set to 0 (the square clipped at the borders, as the Cutout of FedGKT's loader)."""
  half = length // 2
  i, j = jnp.arange(x.shape[1]), jnp.arange(x.shape[2])
  inside = lambda pos, centre: (pos[None] >= centre[:, None] - half) & (pos[None] < centre[:, None] + half)
  cut = inside(i, rows)[:, :, None] & inside(j, cols)[:, None, :]
  return jnp.where(cut[..., None], jnp.zeros((), x.dtype), x)


def random_cutout(x: jnp.ndarray, key: jax.Array, length: int = CUTOUT_LENGTH) -> jnp.ndarray:
  """`cutout` around each image's centre drawn uniformly over its pixels (np.random.randint(h), randint(w))."""
  k_row, k_col = jax.random.split(key)
  return cutout(x, jax.random.randint(k_row, x.shape[:1], 0, x.shape[1]),
                jax.random.randint(k_col, x.shape[:1], 0, x.shape[2]), length)


def check_augmentation(kind: str, image_shape: Sequence[int]) -> Optional[str]:
  """Refuses augmentation `kind` on images of `image_shape` (H, W, ...) where it can leave nothing of an image: a
  crop whose padding (CROP_PADDING) is not smaller than a side of the image (a window can then lie wholly in the
  padding), or a Cutout square (CUTOUT_LENGTH) not smaller than the image (a cut can then erase all of it; on 8 x 8
  images every cut does). A ConfigError naming the size and the fix. Returns a caution where the crop's shift is a
  quarter of the image's side or more (on such small images training can stay near chance), else None."""
  if kind == 'none':
    return None
  h, w = int(image_shape[0]), int(image_shape[1])
  resize = 'or images resized to 32 x 32 first (Dataset.resized(32)), the size the CIFAR references augment'
  if CROP_PADDING >= min(h, w):
    raise ConfigError(f'LocalTraining.augment={kind!r} on {h}x{w} images: its random crop pads them by {CROP_PADDING} '
                      f'pixels, not less than the image\'s side, so a crop can hold no pixel of the image. Fix: '
                      f'LocalTraining.augment=\'none\', {resize}.')
  half = CUTOUT_LENGTH // 2
  if kind == 'crop_flip_cutout' and 2 * half >= max(h, w):
    erased = 'every cut erases the whole image' if half >= max(h, w) else 'a cut can erase the whole image'
    raise ConfigError(f'LocalTraining.augment={kind!r} on {h}x{w} images: its {CUTOUT_LENGTH}x{CUTOUT_LENGTH} Cutout '
                      f'square is not smaller than the image, so {erased}. Fix: LocalTraining.augment=\'none\', '
                      f'{resize}.')
  if 4 * CROP_PADDING >= min(h, w):
    return (f'LocalTraining.augment={kind!r} on {h}x{w} images: its crops shift an image by up to {CROP_PADDING} '
            f'pixels, a quarter of its side or more (the CIFAR references shift 32x32 images by up to an eighth); on '
            f'such small images training can stay near chance accuracy. Images resized first (Dataset.resized(32)) '
            f'avoid it.')
  return None


def augment_batch(x: jnp.ndarray, key: jax.Array, kind: str, fill: Sequence[float]) -> jnp.ndarray:
  """A training batch x [B, H, W, C] under augmentation `kind` ('none': as it is; 'crop_flip': `random_crop_flip`
  with padding 4 of `fill`, the value of a black pixel in the run's normalisation; 'crop_flip_cutout': then
  `random_cutout` of side 16), from the step's `key`."""
  if kind == 'none':
    return x
  key = jax.random.fold_in(key, _AUGMENT_STREAM)
  x = random_crop_flip(x, key, CROP_PADDING, fill)
  return random_cutout(x, jax.random.fold_in(key, 1)) if kind == 'crop_flip_cutout' else x
