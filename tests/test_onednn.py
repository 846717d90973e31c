"""oneDNN's convolution as XLA custom calls (fedjax_het/kernels/onednn.py, through models.conv's
onednn_conv_general_dilated): hand-computed values and gradients, lax's values and derivatives of every order, vmap,
empty batches, its threads, and the errors without it."""

import ctypes
import platform
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import tree_allclose
from fedjax_het.engine import ExecutionConfig
from fedjax_het.engine.sharding import CLIENTS_AXIS
from fedjax_het.errors import ConfigError
from fedjax_het.kernels import onednn
from fedjax_het.models.conv import onednn_conv_general_dilated

DN = ('NHWC', 'HWIO', 'NHWC')
# The onednn extra (part of the test extra) installs on Linux x86-64: there every test here must pass, not skip.
INSTALLABLE = sys.platform == 'linux' and platform.machine() == 'x86_64'
needs_onednn = pytest.mark.skipif(not INSTALLABLE, reason="the onednn extra installs on Linux x86-64 only")


def conv(x, w, strides=(1, 1), padding='VALID', dilation=(1, 1), groups=1):
  return onednn_conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=DN,
                                     feature_group_count=groups)


def reference(x, w, strides=(1, 1), padding='VALID', dilation=(1, 1), groups=1):
  return lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=dilation, dimension_numbers=DN,
                                  feature_group_count=groups)


def test_available_where_the_test_extra_installs_it():
  if INSTALLABLE:
    assert onednn.unavailable_reason() is None
    assert onednn.version().startswith('3.')


@needs_onednn
def test_the_passes_are_oneDNNs_custom_calls():
  x, w = jnp.ones((2, 6, 6, 3)), jnp.ones((3, 3, 3, 4))
  step = jax.jit(jax.grad(lambda x, w: jnp.sum(conv(x, w) ** 2), (0, 1))).lower(x, w).as_text()
  for target in ('forward', 'input_gradient', 'kernel_gradient'):
    assert f'fedjax_het_onednn_conv_{target}' in step
  assert 'convolution' not in step  # no XLA convolution left


@needs_onednn
def test_a_window_larger_than_the_padded_input_gives_an_empty_output():
  x, w = jnp.ones((2, 3, 3, 2)), jnp.ones((5, 5, 2, 4))
  assert conv(x, w).shape == reference(x, w).shape == (2, 0, 0, 4)
  dx, dw = jax.grad(lambda x, w: jnp.sum(conv(x, w)), (0, 1))(x, w)
  np.testing.assert_array_equal(dx, np.zeros(x.shape))
  np.testing.assert_array_equal(dw, np.zeros(w.shape))


@needs_onednn
def test_values_and_gradients_by_hand():
  x = jnp.arange(9.0).reshape(1, 3, 3, 1)  # [[0 1 2] [3 4 5] [6 7 8]]
  w = jnp.ones((2, 2, 1, 1))
  np.testing.assert_array_equal(jax.jit(conv)(x, w)[0, :, :, 0], [[8, 12], [20, 24]])  # sums of 2x2 windows
  dx, dw = jax.grad(lambda x, w: jnp.sum(conv(x, w)), (0, 1))(x, w)
  np.testing.assert_array_equal(dx[0, :, :, 0], [[1, 2, 1], [2, 4, 2], [1, 2, 1]])  # windows covering each pixel
  np.testing.assert_array_equal(dw[:, :, 0, 0], [[8, 12], [20, 24]])  # each tap's sum over the windows
  # stride 2 and one pixel of zero padding: windows at (-1, -1), (-1, 1), (1, -1), (1, 1)
  np.testing.assert_array_equal(conv(x, w, (2, 2), [(1, 1), (1, 1)])[0, :, :, 0], [[0, 1 + 2], [3 + 6, 4 + 5 + 7 + 8]])


@needs_onednn
@pytest.mark.parametrize('strides,padding,dilation', [((1, 1), 'VALID', (1, 1)), ((2, 1), [(1, 2), (0, 1)], (1, 1)),
                                                      ((1, 2), 'SAME', (2, 1)), ((2, 2), 'SAME', (1, 1))])
def test_values_and_derivatives_of_two_orders_equal_lax(strides, padding, dilation):
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 9, 11, 3))
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 2, 3, 5))
  ours = lambda x, w: conv(x, w, strides, padding, dilation)
  theirs = lambda x, w: reference(x, w, strides, padding, dilation)
  np.testing.assert_allclose(jax.jit(ours)(x, w), theirs(x, w), rtol=1e-5, atol=1e-5)
  loss = lambda c: lambda x, w: jnp.sum(jnp.sin(c(x, w)))
  tree_allclose(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(theirs), (0, 1))(x, w), rtol=1e-4, atol=1e-4)
  # grad of grad: the passes' VJPs are each other (an input-gradient penalty's kernel gradient, a Hessian product)
  penalty = lambda c: lambda w, x: jnp.sum(jax.grad(loss(c), 0)(x, w) ** 2)
  close_at_float32_scale(jax.grad(penalty(ours), (0, 1))(w, x), jax.grad(penalty(theirs), (0, 1))(w, x))
  kernel_grad = lambda c: lambda x, w: jnp.sum(jax.grad(loss(c), 1)(x, w) ** 2)
  close_at_float32_scale(jax.grad(kernel_grad(ours), (0, 1))(x, w), jax.grad(kernel_grad(theirs), (0, 1))(x, w))


def close_at_float32_scale(actual, desired):
  """Each leaf equal up to rtol 1e-4 and a few units of float32 rounding of its largest entry: second-order
  derivatives sum many products of entries up to ~1e3, so an entry near 0.5 can differ by ~1e-3 between kernels
  that order their sums differently (oneDNN's AVX2 and AVX-512 ones, its thread counts); a wrong VJP is off by the
  entries' own size."""
  for a, d in zip(jax.tree.leaves(actual), jax.tree.leaves(desired)):
    np.testing.assert_allclose(a, d, rtol=1e-4, atol=max(1e-3, 4e-6 * float(np.max(np.abs(d)))))


@needs_onednn
def test_grouped_and_depthwise_values_by_hand():
  # two groups of one channel each (depthwise): channel 0 is x, channel 1 is 10 x; kernels of ones and of twos
  x = jnp.stack([jnp.arange(9.0).reshape(3, 3), 10 * jnp.arange(9.0).reshape(3, 3)], -1)[None]
  w = jnp.stack([jnp.ones((2, 2)), 2 * jnp.ones((2, 2))], -1)[:, :, None, :]  # [2, 2, 1, 2]
  y = jax.jit(lambda x, w: conv(x, w, groups=2))(x, w)
  np.testing.assert_array_equal(y[0, :, :, 0], [[8, 12], [20, 24]])  # channel 0's window sums
  np.testing.assert_array_equal(y[0, :, :, 1], [[160, 240], [400, 480]])  # 2 x channel 1's, never channel 0's
  dx, dw = jax.grad(lambda x, w: jnp.sum(conv(x, w, groups=2)), (0, 1))(x, w)
  np.testing.assert_array_equal(dx[0, :, :, 0], [[1, 2, 1], [2, 4, 2], [1, 2, 1]])
  np.testing.assert_array_equal(dx[0, :, :, 1], 2 * np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]]))
  np.testing.assert_array_equal(dw[:, :, 0, 0], [[8, 12], [20, 24]])
  np.testing.assert_array_equal(dw[:, :, 0, 1], [[80, 120], [200, 240]])


@needs_onednn
@pytest.mark.parametrize('groups,cin,cout,strides', [(6, 6, 6, (1, 1)), (6, 6, 12, (2, 2)), (2, 4, 6, (1, 2)),
                                                     (3, 6, 3, (2, 1))])
def test_grouped_values_and_derivatives_equal_lax(groups, cin, cout, strides):
  """Depthwise (groups = input channels, MobileNetV2's), with a channel multiplier, and grouped."""
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 9, 8, cin))
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, cin // groups, cout))
  ours = lambda x, w: conv(x, w, strides, 'SAME', groups=groups)
  theirs = lambda x, w: reference(x, w, strides, 'SAME', groups=groups)
  step = jax.jit(jax.grad(lambda x, w: jnp.sum(ours(x, w) ** 2), (0, 1))).lower(x, w).as_text()
  assert 'fedjax_het_onednn_conv_kernel_gradient' in step and 'convolution' not in step
  np.testing.assert_allclose(jax.jit(ours)(x, w), theirs(x, w), rtol=1e-5, atol=1e-5)
  loss = lambda c: lambda x, w: jnp.sum(jnp.sin(c(x, w)))
  tree_allclose(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(theirs), (0, 1))(x, w), rtol=1e-4, atol=1e-4)
  penalty = lambda c: lambda w, x: jnp.sum(jax.grad(loss(c), 0)(x, w) ** 2)
  tree_allclose(jax.grad(penalty(ours), (0, 1))(w, x), jax.grad(penalty(theirs), (0, 1))(w, x), rtol=1e-4, atol=1e-3)


@needs_onednn
def test_groups_that_do_not_divide_the_channels_are_refused():
  with pytest.raises(ValueError, match='multiple of the groups'):
    onednn.conv2d(jnp.ones((1, 4, 4, 6)), jnp.ones((3, 3, 2, 4)), (1, 1), [(1, 1), (1, 1)], (1, 1), groups=3)


@needs_onednn
def test_vmap_over_clients_equals_each_client_alone():
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 8, 8, 4))  # 3 clients, each with its own kernel
  w = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 3, 4, 6))
  batched = jax.jit(jax.vmap(lambda x, w: jax.grad(lambda w: jnp.sum(conv(x, w, padding='SAME') ** 2))(w)))(x, w)
  for k in range(3):
    alone = jax.grad(lambda w: jnp.sum(reference(x[k], w, padding='SAME') ** 2))(w[k])
    np.testing.assert_allclose(batched[k], alone, rtol=1e-4, atol=1e-3)


@needs_onednn
def test_an_empty_batch_gives_zeros():
  x, w = jnp.zeros((0, 6, 6, 2)), jnp.ones((3, 3, 2, 4))
  y, dw = jax.jit(lambda x, w: (conv(x, w), jax.grad(lambda w: jnp.sum(conv(x, w)))(w)))(x, w)
  assert y.shape == (0, 4, 4, 4)
  np.testing.assert_array_equal(dw, np.zeros((3, 3, 2, 4)))


@needs_onednn
def test_what_it_does_not_cover_goes_to_lax():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 7, 4))
  grouped = jax.random.normal(jax.random.PRNGKey(1), (3, 3, 4, 8))
  batch_grouped = lambda f: f(x, grouped, (1, 1), 'SAME', dimension_numbers=DN, batch_group_count=2)
  np.testing.assert_allclose(  # batch groups, float16, cropping (negative padding)
      batch_grouped(onednn_conv_general_dilated), batch_grouped(lax.conv_general_dilated), rtol=1e-6)
  assert 'custom_call' not in jax.jit(lambda: batch_grouped(onednn_conv_general_dilated)).lower().as_text()
  w = jax.random.normal(jax.random.PRNGKey(2), (3, 3, 4, 2))
  half = conv(x.astype(jnp.float16), w.astype(jnp.float16))
  assert half.dtype == jnp.float16
  np.testing.assert_allclose(conv(x, w, padding=[(-1, 0), (0, 0)]), reference(x, w, padding=[(-1, 0), (0, 0)]),
                             rtol=1e-5, atol=1e-5)


@needs_onednn
def test_threads_give_the_same_numbers_each_time_and_leave_the_callers_openmp_setting():
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 16, 16, 3))
  w = jax.random.normal(jax.random.PRNGKey(1), (5, 5, 3, 8))
  grads = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.sin(conv(x, w))), (0, 1)))
  gomp = ctypes.CDLL('libgomp.so.1')  # the OpenMP runtime oneDNN runs on, shared with the process
  try:
    for threads in (1, 2):
      onednn.set_threads(threads)
      first = grads(x, w)
      tree_allclose(grads(x, w), first, rtol=0, atol=0)
      tree_allclose(first, jax.grad(lambda x, w: jnp.sum(jnp.sin(reference(x, w))), (0, 1))(x, w), rtol=1e-4,
                    atol=1e-3)
    gomp.omp_set_num_threads(3)
    onednn.set_threads(1)
    jax.block_until_ready(grads(x + 1, w))
    assert gomp.omp_get_max_threads() == 3  # e.g. PyTorch's threads, when it shares the runtime
  finally:
    onednn.set_threads(0)


def test_without_onednn_the_errors_say_why_and_how_to_fix(tmp_path, monkeypatch):
  with pytest.raises(ConfigError, match=r"oneDNN 3\.x was not found \(looked for .* under " + str(tmp_path)
                     + r"\)\. Fix: pip install -e '\.\[onednn\]'"):
    onednn.find_onednn([str(tmp_path)])
  (tmp_path / 'include' / 'oneapi' / 'dnnl').mkdir(parents=True)
  (tmp_path / 'include' / 'oneapi' / 'dnnl' / 'dnnl.hpp').write_text('#error not a oneDNN header\n')
  (tmp_path / 'lib').mkdir()
  (tmp_path / 'lib' / 'libdnnl.so.3').write_text('')
  include, lib = onednn.find_onednn([str(tmp_path)])
  with pytest.raises(ConfigError, match=r"(?s)building the oneDNN convolution handlers failed:.*not a oneDNN "
                                        r"header.*Fix: use --conv=auto"):
    onednn.build(include, lib, cache=str(tmp_path / 'cache'))
  monkeypatch.setenv('CXX', str(tmp_path / 'no-such-compiler'))
  monkeypatch.setattr(onednn.shutil, 'which', lambda name: None)
  with pytest.raises(ConfigError, match=r'no C\+\+ compiler was found.*Fix: install one'):
    onednn.build(include, lib, cache=str(tmp_path / 'cache'))


@pytest.mark.slow  # builds the C++ handlers three times (about 25 s on a 2-core CPU)
@needs_onednn
def test_a_damaged_cached_library_is_built_again_never_loaded(tmp_path):
  """A cached library cut short (a full disk, a copy stopped halfway) once crashed every run on the CPU at start
  (SIGBUS while loading it); now it is checked against the fingerprint written beside it and built again."""
  import os
  import subprocess
  home = tmp_path / 'home'
  folder = home / '.cache' / 'fedjax_het' / 'onednn'
  probe = [sys.executable, '-c', 'from fedjax_het.kernels import onednn; print(onednn.unavailable_reason())']
  env = {**os.environ, 'HOME': str(home)}
  first = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=300)
  assert first.returncode == 0 and first.stdout.strip() == 'None', first.stderr[-2000:]
  (library,) = [p for p in folder.iterdir() if p.suffix == '.so']
  whole = library.stat().st_size
  log = (folder / (library.name + '.log')).read_text()  # the build's command and its warnings (none: -Wall)
  assert '-Wall' in log and '-w ' not in log and log.strip().count('\n') == 0, log
  assert 'built with warnings' not in first.stderr
  for damaged in (library.read_bytes()[:whole // 2], b''):
    library.write_bytes(damaged)
    again = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == 'None', again.stderr[-2000:]
    assert (f'the cached convolution handlers {library} are damaged ({len(damaged)} bytes where {whole} were '
            f'written); building them again.') in again.stderr
    assert library.stat().st_size == whole


@needs_onednn
@pytest.mark.slow
def test_unfinished_builds_of_gone_processes_are_removed_and_an_unwritable_cache_is_not_needed(tmp_path, caplog,
                                                                                                 monkeypatch):
  import os
  include, lib = onednn.find_onednn()
  cache = tmp_path / 'cache'
  cache.mkdir()
  gone = cache / 'onednn_conv_0123456789abcdef.so.999999999.1.tmp'  # no process has that id
  running = cache / f'onednn_conv_0123456789abcdef.so.{os.getpid()}.1.tmp'
  gone.write_bytes(b'half a library')
  running.write_bytes(b'a build under way')
  path = onednn.build(include, lib, cache=str(cache))
  assert not gone.exists() and running.exists() and os.path.dirname(path) == str(cache)
  assert f'removed {gone}, a build left unfinished by process 999999999.' in caplog.text
  real_access = os.access
  monkeypatch.setattr(onednn.os, 'access', lambda p, mode: False if str(p) == str(tmp_path / 'locked') else
                      real_access(p, mode))
  (tmp_path / 'locked').mkdir()
  elsewhere = onednn.build(include, lib, cache=str(tmp_path / 'locked'))
  assert os.path.dirname(elsewhere) != str(tmp_path / 'locked') and os.path.exists(elsewhere)
  assert f'the cache folder {tmp_path / "locked"} cannot be written' in caplog.text
  assert os.path.dirname(elsewhere) in onednn._TEMPORARY


@pytest.fixture(scope='module')
def onednn_run(tiny_data):
  """Two rounds of the tiny federation with oneDNN's convolutions, two client threads, one oneDNN thread each."""
  from test_engine import make_fed, run
  return run(make_fed(tiny_data, 'sequential', conv='onednn', client_threads=2, onednn_threads=1), 2)


@needs_onednn
def test_a_federation_with_onednn_computes_what_xla_computes(tiny_data, onednn_run):
  from test_engine import make_fed, run
  s_xla, h_xla = run(make_fed(tiny_data, 'sequential', conv='xla'), 2)
  s_dnnl, h_dnnl = onednn_run
  tree_allclose(s_dnnl, s_xla, rtol=1e-3, atol=1e-4)
  for a, b in zip(h_dnnl, h_xla):
    for key in a:
      if 'seconds' not in key and isinstance(a[key], float):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-3, atol=1e-4, err_msg=key)
  # the same numbers whatever the client threads, oneDNN's own threads fixed (each call has its own scratchpad)
  s_one, _ = run(make_fed(tiny_data, 'sequential', conv='onednn', client_threads=1, onednn_threads=1), 2)
  tree_allclose(s_one, s_dnnl, rtol=0, atol=0)


def test_asking_for_it_elsewhere_than_the_cpu_is_refused():
  with pytest.raises(ConfigError, match="runs on the CPU only"):
    ExecutionConfig(conv='onednn').resolve('tpu')


@needs_onednn
def test_each_federation_runs_with_its_own_threads(tiny_data, onednn_run):
  """oneDNN's threads are a setting of the process: a federation built after another (here under vmap, every core
  per convolution) must not change the first's numbers."""
  from test_engine import make_fed, run
  first = make_fed(tiny_data, 'sequential', conv='onednn', client_threads=2, onednn_threads=1)
  make_fed(tiny_data, 'vmap', conv='onednn', onednn_threads=2)
  after_another, _ = run(first, 2)
  tree_allclose(after_another, onednn_run[0], rtol=0, atol=0)


def test_the_default_under_a_client_mesh_is_im2col():
  mesh = types.SimpleNamespace(axis_names=(CLIENTS_AXIS,), size=4)  # the custom call's loop cannot be split
  assert ExecutionConfig(strategy='vmap', client_mesh=mesh).resolve('cpu').conv == 'im2col'
