"""The Pallas convolution kernels (kernels/pallas_conv.py), run in Pallas's interpreter on the CPU, and lowered for
a GPU without one (Triton's IR is built here; its compilation to PTX happens on the device)."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tree_allclose
from fedjax_het.engine.execution import ExecutionConfig
from fedjax_het.errors import ConfigError
from fedjax_het.kernels import pallas_conv
from fedjax_het.models import build_model
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.models.forward import forward

DN = ('NHWC', 'HWIO', 'NHWC')


def lax_conv(x, w, padding):
  return jax.lax.conv_general_dilated(x, w, (1, 1), padding, dimension_numbers=DN)


def test_a_hand_computed_convolution_and_its_gradients():
  x = jnp.arange(1., 10.).reshape(1, 3, 3, 1)  # [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
  w = jnp.array([[1., 2.], [3., 4.]]).reshape(2, 2, 1, 1)
  conv = lambda x, w: pallas_conv.conv2d(x, w, ((0, 0), (0, 0)))
  np.testing.assert_array_equal(conv(x, w)[0, :, :, 0], [[37, 47], [67, 77]])  # 1*1 + 2*2 + 4*3 + 5*4 = 37 ...
  dx, dw = jax.grad(lambda x, w: jnp.sum(conv(x, w)), (0, 1))(x, w)
  np.testing.assert_array_equal(dw[:, :, 0, 0], [[12, 16], [24, 28]])  # sums of x under each kernel tap
  np.testing.assert_array_equal(dx[0, :, :, 0], [[1, 3, 2], [4, 10, 6], [3, 7, 4]])  # sums of the taps over x
  # One pixel of zero padding on every side: the corner output sees only x[0, 0] under tap (1, 1).
  padded = pallas_conv.conv2d(x, w, ((1, 1), (1, 1)))
  assert padded.shape == (1, 4, 4, 1) and padded[0, 0, 0, 0] == 4 * 1 and padded[0, 3, 3, 0] == 1 * 9


@pytest.mark.parametrize('x_shape,w_shape,padding', [
    ((2, 12, 12, 3), (5, 5, 3, 8), ((0, 0), (0, 0))),    # cnn4's first layer, smaller
    ((3, 7, 9, 20), (3, 3, 20, 17), ((1, 1), (1, 1))),   # channels past one block of 16
    ((2, 6, 5, 4), (3, 2, 4, 3), ((2, 0), (0, 1))),      # asymmetric kernel and padding
    ((1, 4, 4, 2), (1, 1, 2, 5), ((0, 0), (0, 0))),      # 1x1
    ((2, 5, 6, 3), (3, 3, 3, 4), ((3, 1), (0, 3))),      # padding past the kernel: cropped input gradient
    ((2, 6, 6, 32), (3, 3, 32, 16), ((1, 1), (1, 1))),   # taps not folded (32 channels fill the depth)
])
def test_vmapped_over_clients_equals_xla_per_client_values_and_gradients(x_shape, w_shape, padding):
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (3,) + x_shape)  # 3 clients, each its own kernel
  w = jax.random.normal(kw, (3,) + w_shape)
  loss = lambda conv: lambda x, w: jnp.sum(jnp.sin(conv(x, w, padding)))
  ours = jax.jit(jax.vmap(jax.value_and_grad(loss(pallas_conv.conv2d), (0, 1))))(x, w)
  per_client = [jax.value_and_grad(loss(lax_conv), (0, 1))(x[c], w[c]) for c in range(3)]
  theirs = jax.tree.map(lambda *a: jnp.stack(a), *per_client)
  tree_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(jax.vmap(lambda a, b: pallas_conv.conv2d(a, b, padding))(x, w),
                             jax.vmap(lambda a, b: lax_conv(a, b, padding))(x, w), rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_accumulate_in_float32_and_return_bfloat16():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 8, 4))
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 4, 6))
  out = pallas_conv.conv2d(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), ((1, 1), (1, 1)))
  assert out.dtype == jnp.bfloat16
  exact = lax_conv(x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32),
                   ((1, 1), (1, 1)))
  np.testing.assert_allclose(out.astype(jnp.float32), exact, rtol=2e-2, atol=2e-2)  # bfloat16's output rounding


@pytest.mark.parametrize('height,width,rows', [(28, 28, 4), (10, 10, 2), (3, 3, 4), (32, 32, 4), (1, 64, 1)])
def test_block_rows_fill_a_matmul_of_at_least_16_and_pad_the_height_least(height, width, rows):
  # (28, 28): width 32, rows 1/2/4 all pad 28 to 28 -> 4; (10, 10): width 16, 1 and 2 leave 10, 4 -> 12, 8 -> 16;
  # (3, 3): width 4 needs 4 rows for 16 positions; (1, 64): one row of 64 fills a matmul, more would be padding.
  assert pallas_conv.block_rows(height, width) == rows


def test_tiling_of_cnn4s_layers_by_hand():
  # 3 -> 32, 5x5 onto 28x28: taps folded (5 x 3 = 15 of 16 deep), 4 rows of 32 columns per program.
  first = pallas_conv.tiling(3, 32, (5, 5), (28, 28))
  assert first == pallas_conv.Tiling(True, (5, 1), 16, 32, 4, 32, 28)
  assert first.macs(1) == 28 * 32 * 5 * 16 * 32  # against 28 * 28 * 25 * 3 * 32 useful: 82 %
  # 32 -> 64 onto 10x10: not folded (160 would pad to 256), 2 rows of 16 columns: 62.5 % of the work is useful.
  second = pallas_conv.tiling(32, 64, (5, 5), (10, 10))
  assert second == pallas_conv.Tiling(False, (5, 5), 32, 64, 2, 16, 10)
  assert second.macs(2) == 2 * 10 * 16 * 25 * 32 * 64


def triton_calls(text: str) -> int:
  """Triton kernel launches in a lowered program's text (the custom call's name differs across JAX versions)."""
  return len(re.findall(r'custom_call @[\w$.]*triton|call_target_name = "[^"]*triton', text))


@pytest.mark.parametrize('channels,kernel,folded', [(3, 5, True), (32, 5, False)])
def test_lowers_for_a_gpu_one_launch_per_kernel_for_all_clients_and_no_patches(channels, kernel, folded):
  """On the CPU, without a GPU: the vmapped training step's convolution lowers to Triton kernels (their shapes
  pass Triton's power-of-2 and matmul-size rules), one launch each for the forward pass, the input gradient and
  the kernel gradient, whatever the number of clients; no XLA convolution and no im2col patches (kh*kw*C wide),
  only the kw-fold tap copy where the channels are few."""
  assert pallas_conv.folds_taps(channels, kernel) == folded

  def grads(clients):
    x = jnp.zeros((clients, 4, 28, 28, channels))
    w = jnp.zeros((clients, kernel, kernel, channels, 32))
    loss = lambda x, w: jnp.sum(pallas_conv.conv2d(x, w, ((1, 1), (1, 1))) ** 2)
    return jax.jit(jax.vmap(jax.grad(loss, (0, 1)))).trace(x, w).lower(lowering_platforms=('cuda',)).as_text()
  for clients in (1, 64):
    text = grads(clients)
    assert triton_calls(text) == 3
    assert 'stablehlo.convolution' not in text and f'x{kernel * kernel * channels}xf32>' not in text
    assert (f'x{kernel * channels}xf32>' in text) == folded


def test_a_bfloat16_step_lowers_for_a_gpu_too():
  """--precision=bfloat16's convolutions: bfloat16 operands, float32 accumulation, in the same three launches."""
  x = jnp.zeros((8, 4, 14, 14, 32), jnp.bfloat16)
  w = jnp.zeros((8, 5, 5, 32, 64), jnp.bfloat16)
  loss = lambda x, w: jnp.sum(pallas_conv.conv2d(x, w, ((0, 0), (0, 0))).astype(jnp.float32) ** 2)
  text = jax.jit(jax.vmap(jax.grad(loss, (0, 1)))).trace(x, w).lower(lowering_platforms=('cuda',)).as_text()
  assert triton_calls(text) == 3 and 'stablehlo.convolution' not in text


def test_the_pallas_formulation_keeps_strided_layers_on_im2col():
  conv = CONV_IMPLS['pallas'].keywords['conv_general_dilated']
  x, w = jnp.zeros((2, 9, 9, 3)), jnp.zeros((3, 3, 3, 4))
  lowered = lambda strides: jax.jit(lambda x, w: conv(x, w, strides, 'SAME', dimension_numbers=DN)).trace(
      x, w).lower(lowering_platforms=('cuda',)).as_text()
  assert triton_calls(lowered((1, 1))) == 1
  assert triton_calls(lowered((2, 2))) == 0 and 'x27xf32>' in lowered((2, 2))  # im2col's 3 x 3 x 3 patches


def test_bad_arguments_and_backends_are_refused_with_a_fix():
  with pytest.raises(ValueError, match=r'pallas_conv.conv2d: .*Fix: pass channels-last'):
    pallas_conv.conv2d(jnp.zeros((1, 4, 4, 3)), jnp.zeros((3, 3, 2, 4)), ((1, 1), (1, 1)))
  with pytest.raises(ValueError, match=r'>= 0'):
    pallas_conv.conv2d(jnp.zeros((1, 4, 4, 3)), jnp.zeros((3, 3, 3, 4)), ((-1, 0), (0, 0)))
  with pytest.raises(ConfigError, match=r"^ExecutionConfig.conv='pallas' compiles Triton kernels for GPUs "
                                        r"\(backend: cpu\).*Fix: conv='im2col'"):
    ExecutionConfig(conv='pallas').resolve('cpu')
  with pytest.raises(ConfigError, match=r"^ExecutionConfig.conv='pallas' with num_devices=2: .*Fix: conv='im2col', "
                                        r"or num_devices=1"):
    two_devices = types.SimpleNamespace(size=2, axis_names=('clients',))  # a client mesh's size and axis
    ExecutionConfig(conv='pallas', client_mesh=two_devices).resolve('gpu')
  assert ExecutionConfig(conv='pallas').resolve('gpu').conv == 'pallas'


@pytest.mark.slow
def test_two_sgd_steps_of_cnn4_scanned_and_vmapped_over_clients_equal_im2cols():
  """The kernels inside a local epoch as the vmap executor runs one: SGD steps in lax.scan, vmapped over clients,
  the state donated; cnn4 with conv='pallas' ends where it does with im2col."""
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 2, 2, 32, 32, 3))  # [clients, steps, rows, ...]
  y = jax.random.randint(jax.random.PRNGKey(1), (2, 2, 2), 0, 10)

  def train(conv):
    model = build_model('cnn4', 10, 16, conv=conv)
    params = jax.vmap(lambda k: model.init(k, x[0, 0])['params'])(jax.random.split(jax.random.PRNGKey(2), 2))

    def step(p, batch):
      def loss(p):
        logits = forward(model, p, {}, batch[0], True)[0]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[1][:, None], 1))
      value, grad = jax.value_and_grad(loss)(p)
      return jax.tree.map(lambda a, g: a - 0.1 * g, p, grad), value
    epoch = jax.jit(jax.vmap(lambda p, xs, ys: jax.lax.scan(step, p, (xs, ys))), donate_argnums=0)
    return epoch(params, x, y)
  tree_allclose(train('pallas'), train('im2col'), rtol=1e-4, atol=1e-5)
