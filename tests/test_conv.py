import platform
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from fedjax_het.errors import ConfigError
from fedjax_het.models import build_model
from fedjax_het.models.conv import CONV_IMPLS, conv_factory
from fedjax_het.models.forward import forward
from fedjax_het.models.pooling import max_pool


# oneDNN's: where the onednn extra installs (Linux x86-64; tests/test_onednn.py fails there without it)
ONEDNN = ['onednn'] if sys.platform == 'linux' and platform.machine() == 'x86_64' else []
FORMULATIONS = [c for c in CONV_IMPLS if c in ONEDNN or c != 'onednn']


@pytest.mark.parametrize('impl', ['im2col', 'auto', 'gemm', 'pallas'] + ONEDNN)
@pytest.mark.parametrize('kw', [dict(features=5, kernel_size=(3, 3)),
                                dict(features=4, kernel_size=(5, 5), padding='VALID'),
                                dict(features=4, kernel_size=(7, 7), strides=2, padding=3, use_bias=False),
                                dict(features=4, kernel_size=(3, 3), kernel_dilation=2),
                                dict(features=4, kernel_size=(3, 3), strides=2, padding='SAME'),
                                dict(features=4, kernel_size=(1, 1), strides=2),
                                dict(features=3, kernel_size=(3, 3), feature_group_count=3)])  # falls back
def test_conv_formulations_equal_xla_conv_values_and_gradients(impl, kw):
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 9, 3))
  xla, other = CONV_IMPLS['xla'](**kw), CONV_IMPLS[impl](**kw)
  params = xla.init(jax.random.PRNGKey(1), x)
  assert jax.tree.structure(params) == jax.tree.structure(other.init(jax.random.PRNGKey(1), x))
  np.testing.assert_allclose(other.apply(params, x), xla.apply(params, x), rtol=1e-5, atol=1e-5)
  grad = lambda m: jax.grad(lambda p, x: jnp.sum(jnp.sin(m.apply(p, x))), argnums=(0, 1))(params, x)
  tree_allclose(grad(other), grad(xla), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('window,strides,padding', [((2, 2), (2, 2), 'VALID'), ((2, 2), (2, 2), 'SAME'),
                                                    ((3, 3), (2, 2), ((1, 1), (1, 1)))])
@pytest.mark.parametrize('shape', [(2, 8, 8, 3), (2, 9, 7, 3)])
def test_max_pool_equals_flax_values_and_gradients(window, strides, padding, shape):
  x = jax.random.normal(jax.random.PRNGKey(0), shape)
  ours = lambda x: max_pool(x, window, strides, padding)
  theirs = lambda x: nn.max_pool(x, window, strides, padding)
  np.testing.assert_array_equal(ours(x), theirs(x))
  grad = lambda f: jax.grad(lambda x: jnp.sum(jnp.sin(f(x))))(x)
  np.testing.assert_allclose(grad(ours), grad(theirs), rtol=1e-6)


# resnet6 (BatchNorm, a strided block, a projection) in the slow set.
@pytest.mark.parametrize('name', ['cnn4', pytest.param('resnet6', marks=pytest.mark.slow)])
def test_models_are_the_same_function_under_vmap_with_either_conv(name):
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 32, 32, 3))  # 3 clients, 2 rows each
  models = {c: build_model(name, 10, 32, conv=c) for c in FORMULATIONS}
  variables = jax.jit(jax.vmap(lambda k: models['xla'].init(k, x[0])))(jax.random.split(jax.random.PRNGKey(1), 3))
  params = variables.pop('params')
  # Eval mode: train-mode BatchNorm over 2 rows would amplify float rounding into the comparison. Jitted, as the
  # vmap executor runs them.
  out = {c: jax.jit(jax.vmap(lambda p, s, xi, m=m: forward(m, p, s, xi, False)[:2]))(params, dict(variables), x)
         for c, m in models.items()}
  for c in FORMULATIONS:
    tree_allclose(out[c], out['xla'], rtol=1e-4, atol=1e-4)


def test_gemm_kernel_gradient_under_vmap_is_a_batched_matmul_with_xlas_values():
  """Under vmap over clients, 'gemm' computes each client's kernel gradient as one batched dot_general (no
  grouped convolution in the backward pass) and equals XLA's gradients."""
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 9, 9, 4))  # 3 clients
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 4, 5))
  kw = dict(window_strides=(1, 1), padding='SAME', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  conv = {'xla': jax.lax.conv_general_dilated, 'gemm': CONV_IMPLS['gemm'].keywords['conv_general_dilated']}
  loss = lambda f: lambda x, w: jnp.sum(jnp.sin(jax.vmap(lambda a, b: f(a, b, **kw))(x, w)))
  grads = {name: jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w) for name, f in conv.items()}
  tree_allclose(grads['gemm'], grads['xla'], rtol=1e-4, atol=1e-5)
  hlo = jax.jit(jax.grad(loss(conv['gemm']), argnums=1)).lower(x, w).as_text()
  assert hlo.count('stablehlo.convolution') == 1  # the forward pass only
  assert 'stablehlo.dot_general' in hlo


def test_unknown_conv_names_the_argument():
  with pytest.raises(ConfigError, match="^ExecutionConfig.conv='winograd' is unknown"):
    conv_factory('winograd')


@pytest.mark.slow  # two federations' rounds (6 s); the formulations' values are checked one by one above
def test_representation_passes_of_an_auto_run_take_im2col_up_to_32_channels_with_the_same_values():
  """An 'auto' run computes its eval-mode representation passes with im2col for cnn4's 32 -> 64 convolution too
  (no native convolution left), the same parameters and values; other runs use their own classifier."""
  import types
  from fedjax_het.engine.groups import ClassifierMaker, representation_model
  maker = ClassifierMaker(10, 'ap', 'auto', 'torch', 0)
  spec = types.SimpleNamespace(conv='auto', maker=maker, arch='cnn4', feature_dim=16,
                               model=build_model('cnn4', 10, 16, 'ap', 'auto'))
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32, 32, 3))
  params = spec.model.init(jax.random.PRNGKey(1), x)['params']
  reps = lambda model: jax.jit(lambda p, v: forward(model, p, {}, v, False)[1])
  native = lambda model: reps(model).lower(params, x).as_text().count('stablehlo.convolution')
  passes = representation_model(spec)
  assert native(spec.model) == 1 and native(passes) == 0  # 'auto' keeps XLA's 32 -> 64 convolution in training
  np.testing.assert_allclose(reps(passes)(params, x), reps(spec.model)(params, x), rtol=1e-5, atol=1e-5)
  assert representation_model(types.SimpleNamespace(**{**vars(spec), 'conv': 'xla'})) is spec.model
