import numpy as np
import jax.numpy as jnp

from fedjax_het.models.pooling import adaptive_avg_pool1d, adaptive_bins, adaptive_max_pool1d


def torch_rule(length, size):
  return [(int(np.floor(i * length / size)), int(np.ceil((i + 1) * length / size))) for i in range(size)]


def test_bins_match_pytorch_rule_including_overlaps():
  for length, size in [(5, 3), (1280, 512), (768, 512), (2048, 512), (512, 512), (7, 7), (3, 5)]:
    assert adaptive_bins(length, size) == torch_rule(length, size)
  bins = adaptive_bins(1280, 512)
  assert any(b[0] < a[1] for a, b in zip(bins, bins[1:]))  # 1280 -> 512 bins overlap


def test_adaptive_pooling_hand_computed():
  v = jnp.array([[1., 2., 3., 4., 5.]])
  # bins [0,2), [1,4), [3,5)
  np.testing.assert_allclose(adaptive_avg_pool1d(v, 3), [[1.5, 3.0, 4.5]])
  np.testing.assert_allclose(adaptive_max_pool1d(v, 3), [[2.0, 4.0, 5.0]])
  np.testing.assert_allclose(adaptive_avg_pool1d(v, 5), v)


def test_adaptive_avg_pool_2048_to_512_is_group_mean():
  v = jnp.arange(2048.)[None]
  np.testing.assert_allclose(adaptive_avg_pool1d(v, 512), v.reshape(1, 512, 4).mean(-1))
