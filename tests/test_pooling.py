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


def test_max_pool_2d_values_and_pytorchs_tie_rule_for_the_gradient():
  """2x2 max pooling: flax's values; the gradient of each window goes to its FIRST maximal element in row-major
  order (PyTorch's max_pool2d), never split among ties (a reduce-max VJP splits it, and at XLA:CPU's level 0 can
  lose it: docs/xla_cpu_miscompile.md)."""
  import flax.linen as nn
  import jax
  from fedjax_het.models.pooling import max_pool
  x = jnp.asarray([[1.0, 3.0, 0.0, 0.0],
                   [3.0, 2.0, 0.0, -1.0],
                   [5.0, 4.0, -2.0, -3.0],
                   [4.0, 5.0, -4.0, -2.0]]).reshape(1, 4, 4, 1)
  np.testing.assert_array_equal(max_pool(x, (2, 2)), nn.max_pool(x, (2, 2), (2, 2)))
  grad = jax.grad(lambda v: jnp.sum(max_pool(v, (2, 2)) * jnp.asarray([1.0, 2.0, 3.0, 4.0]).reshape(1, 2, 2, 1)))(x)
  np.testing.assert_array_equal(grad[0, :, :, 0], [[0.0, 1.0, 2.0, 0.0],
                                                   [0.0, 0.0, 0.0, 0.0],
                                                   [3.0, 0.0, 4.0, 0.0],
                                                   [0.0, 0.0, 0.0, 0.0]])


def test_max_pool_gradient_equals_the_select_chains_on_ties_for_any_window():
  """The pool's gradient, written from each window's winning position, is the gradient of the plain running
  maximum through selects (which routes every window's cotangent to its first maximum), for non-square windows,
  many ties and under vmap."""
  import jax
  from fedjax_het.models.pooling import max_pool

  def select_chain(x, kh, kw):  # the running maximum, differentiated through jnp.where
    b, h, w, c = x.shape
    windows = x.reshape(b, h // kh, kh, w // kw, kw, c)
    out = windows[:, :, 0, :, 0]
    for k in range(1, kh * kw):
      later = windows[:, :, k // kw, :, k % kw]
      out = jnp.where(later > out, later, out)
    return out

  x = jax.random.randint(jax.random.PRNGKey(0), (3, 6, 6, 2), 0, 3).astype(jnp.float32)  # values 0-2: ties
  cot = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 2))
  for kh, kw in ((2, 3), (3, 2), (2, 2)):
    c = cot[:, :6 // kh, :6 // kw]
    got = jax.grad(lambda v: jnp.sum(max_pool(v, (kh, kw)) * c))(x)
    want = jax.grad(lambda v: jnp.sum(select_chain(v, kh, kw) * c))(x)
    np.testing.assert_array_equal(got, want)
  per_example = jax.vmap(jax.grad(lambda v: jnp.sum(max_pool(v[None], (2, 2)))))(x)
  np.testing.assert_array_equal(per_example, jax.grad(lambda v: jnp.sum(max_pool(v, (2, 2))))(x))
