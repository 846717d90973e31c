import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import numpy as np
import pytest

from fedjax_het.data import make_federated_data, make_synthetic


@pytest.fixture(scope='session')
def tiny_data():
  """A small learnable 8x8x1 dataset over 6 clients (Dirichlet 0.5), shared by engine/algorithm tests."""
  ds = make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1)
  return make_federated_data(ds, num_clients=6, partition='dirichlet', seed=3, alpha=0.5)


def tree_allclose(a, b, **kw):
  import jax
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)
