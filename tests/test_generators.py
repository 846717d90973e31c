"""GeFL's generators: paper-size parameter counts, hand-computed values, and a training step and sampler of each at
test size."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_het.generators import cvae, dcgan, ddpm
from fedjax_het.generators.base import bce
from fedjax_het.generators.cvae import cvae_loss
from fedjax_het.generators.dcgan import dcgan_losses, DCGANDiscriminator, DCGANGenerator
from fedjax_het.generators.ddpm import ddpm_schedule, guided, reverse_step

count = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))


def test_paper_size_parameter_counts():
  """Tables V and VI of "GeFL: Model-Agnostic Federated Learning with Generative Models": DCGAN G + D 5.72M
  (3,076,737 + 2,643,329), CVAE 22.35M (decoder 11.17M), U-Net 7,568,641 and U-Net-F 4,427,523 (shapes only,
  nothing is allocated)."""
  shapes = lambda gen: jax.eval_shape(gen.init, jax.random.PRNGKey(0))
  v = shapes(dcgan(10))
  assert (count(v['G']['params']), count(v['D']['params'])) == (3_076_737, 2_643_329)
  v = shapes(cvae(10))
  assert (count(v['params']), count(v['params']['decoder'])) == (22_354_593, 11_172_673)
  assert count(shapes(ddpm(10))['params']) == 7_568_641
  assert count(shapes(ddpm(10, channels=3, size=16))['params']) == 4_427_523


def test_feature_map_variants_parameter_counts_and_shapes():
  """GeFL-F's generators on 16x16 feature maps (Table VI): DCGAN-F G 2.554M and G + D 5.191M, CVAE-F 5.543M, at
  the one channel the code hard-codes; at GeFL-F's 3 channels they emit [B, 16, 16, 3] maps >= 0."""
  shapes = lambda gen: jax.eval_shape(gen.init, jax.random.PRNGKey(0))
  v = shapes(dcgan(10, 1, size=16))
  assert (count(v['G']['params']), count(v['G']['params']) + count(v['D']['params'])) == (2_554_113, 5_191_298)
  assert count(shapes(cvae(10, 1, size=16))['params']) == 5_542_561
  for gen in (dcgan(10, 3, g_width=4, d_width=4, size=16), cvae(10, 3, width=4, latent=3, size=16)):
    variables = jax.jit(gen.init)(jax.random.PRNGKey(0))
    maps = jax.jit(gen.sample)(variables, jnp.arange(3), jax.random.PRNGKey(1))
    assert maps.shape == (3, 16, 16, 3) and float(maps.min()) >= 0.0 and not gen.unit_range


def test_ddpm_schedule_reverse_step_and_guidance_by_hand():
  """T = 4: beta = [1e-4, .005075, .01005, .015025, .02], alphabar = [.9999, .994826, .984828, .97003, .95063]
  (the product includes t = 0); one reverse step at i = 4 from x = 1 with eps = 0.5, z = 0 is 0.964690;
  guidance (1 + 2) 0.5 - 2 * 0.1 = 1.3."""
  s = ddpm_schedule(4)
  np.testing.assert_allclose(s.beta, [1e-4, .005075, .01005, .015025, .02], rtol=1e-5)
  np.testing.assert_allclose(s.alphabar, [.9999, .994826, .984828, .97003, .95063], atol=2e-6)
  np.testing.assert_allclose(reverse_step(s, 4, jnp.ones(1), jnp.full(1, 0.5), jnp.zeros(1)), [0.964690],
                             atol=1e-6)
  np.testing.assert_allclose(guided(jnp.asarray(0.5), jnp.asarray(0.1), 2.0), 1.3, rtol=1e-6)


def test_cvae_loss_reductions_by_hand():
  """pred = x, mu = 0, logvar = 0 -> 0; one row with mu = (1, 1), logvar = 0 -> KL 1.0; sums over the batch."""
  x = jnp.ones((3, 4, 4, 1))
  assert float(cvae_loss(x, x, jnp.zeros((3, 2)), jnp.zeros((3, 2)))) == 0.0
  assert float(cvae_loss(x[:1], x[:1], jnp.ones((1, 2)), jnp.zeros((1, 2)))) == pytest.approx(1.0)
  # summed, not averaged: two rows of KL 1 and one pixel off by 1 in each -> 2 + 2
  off = x[:2].at[:, 0, 0, 0].add(1.0)
  assert float(cvae_loss(off, x[:2], jnp.ones((2, 2)), jnp.zeros((2, 2)))) == pytest.approx(4.0)


def test_dcgan_losses_when_the_discriminator_says_one_half():
  """D = 0.5 everywhere (its last layer zeroed): the D loss is 2 ln 2 = 1.3863, the G loss ln 2 = 0.6931."""
  g, d = DCGANGenerator(8, 1), DCGANDiscriminator(8)
  gen = dcgan(10, g_width=8, d_width=8)
  v = jax.jit(gen.init)(jax.random.PRNGKey(0))
  d_params = {**v['D']['params'], 'conv4': jax.tree.map(jnp.zeros_like, v['D']['params']['conv4'])}
  d_loss, g_loss = dcgan_losses(g.apply, d.apply, 10)
  x, y = jnp.zeros((4, 32, 32, 1)), jnp.arange(4)
  ld, _ = jax.jit(d_loss)(d_params, v['D']['batch_stats'], v['G'], x, y, jax.random.PRNGKey(1))
  lg, _ = jax.jit(g_loss, static_argnums=3)(v['G']['params'], v['G']['batch_stats'],
                                            {**v['D'], 'params': d_params}, 4, jax.random.PRNGKey(2))
  assert float(ld) == pytest.approx(2 * math.log(2), rel=1e-6)
  assert float(lg) == pytest.approx(math.log(2), rel=1e-6)
  assert float(bce(jnp.zeros(2), 1.0)) == pytest.approx(100.0)  # PyTorch's clamp of log(0)


# DCGAN and the CVAE train in the golden GeFL and GeFL-F runs of the default run (tests/test_golden.py); here in
# the slow set (`-m slow`). DDPM trains only here.
@pytest.mark.parametrize('name', [pytest.param('dcgan', marks=pytest.mark.slow),
                                  pytest.param('cvae', marks=pytest.mark.slow), 'ddpm'])
def test_each_generator_trains_and_samples_at_test_size(name):
  """A few Adam steps on a fixed batch lower the loss (DCGAN: the steps change both nets), samples have the data's
  shape, are finite and in the generator's range, and the same key gives the same samples."""
  make = {'dcgan': lambda: dcgan(4, g_width=8, d_width=8), 'cvae': lambda: cvae(4, width=4, latent=3),
          'ddpm': lambda: ddpm(4, width=8, steps=5, guidance=2.0)}[name]
  gen = make()
  key = jax.random.PRNGKey(0)
  v = jax.jit(gen.init)(key)
  opt = jax.jit(gen.init_optimizer)(v)
  x = jax.random.uniform(key, (8, 32, 32, 1), minval=0.0 if gen.unit_range else -1.0, maxval=1.0)
  y = jnp.arange(8) % 4
  step = jax.jit(gen.step)
  losses = []
  v1 = v
  for i in range(4):
    v1, opt, loss = step(v1, opt, x, y, jax.random.PRNGKey(1) if name != 'dcgan' else jax.random.PRNGKey(i))
    losses.append(float(loss))
  assert all(np.isfinite(losses))
  if name == 'dcgan':
    for part in ('G', 'D'):
      assert not np.allclose(jax.tree.leaves(v1[part]['params'])[0], jax.tree.leaves(v[part]['params'])[0])
  else:
    assert losses[-1] < losses[0]
  sample = jax.jit(gen.sample)
  samples = sample(v1, jnp.arange(4), jax.random.PRNGKey(3))
  assert samples.shape == (4, 32, 32, 1) and bool(jnp.all(jnp.isfinite(samples)))
  if gen.unit_range and name == 'cvae':
    assert float(samples.min()) >= 0.0  # ReLU output
  if not gen.unit_range:
    assert float(jnp.abs(samples).max()) <= 1.0
  np.testing.assert_array_equal(samples, sample(v1, jnp.arange(4), jax.random.PRNGKey(3)))
