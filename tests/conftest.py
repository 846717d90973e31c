import atexit
import contextlib
import gc
import os
import shutil
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests run tiny models for a few steps, so XLA:CPU's compile time dominates them; its backend optimisation level
# 0 compiles about 1.6x faster here (tests/test_golden.py still matches numbers pinned at the default level), and
# its legacy loop emitters in place of the MLIR fusion emitters (--xla_cpu_use_fusion_emitters=false) compile
# another 1.4x faster (GeFL's vmap golden run: 33 s -> 19.5 s of backend compilation; the whole suite 585 s ->
# 461 s on the 2-core CI machine), with every golden number still within its tolerance. They run slower (a FedRE
# round 0.84x PyTorch's against 0.97x, benchmarks/vs_pytorch.py), so this is a test setting, not the library's.
# Level 0 can compute wrong gradients through a reduce-max (docs/xla_cpu_miscompile.md; max pooling selects, by
# index and is not affected); benchmarks/vmap_equals_sequential.py checks every method
# at the default level. Its LLVM module compiled whole (--xla_cpu_parallel_codegen_split_count=1) in place of
# XLA's 32 parts, which buy nothing when two workers already keep both cores busy, spends about a fifth less in
# backend compilation (GeFL-F's three-phase fixture in tests/test_gefl_f.py: 14.0-16.4 s -> 10.2-12.2 s).
# FEDJAX_HET_TEST_XLA_OPT=1 keeps XLA's default.
if os.environ.get('FEDJAX_HET_TEST_XLA_OPT', '0') == '0':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_backend_optimization_level=0'
                             ' --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1').strip()
# Two pytest-xdist workers share two cores: XLA:CPU's Eigen kernels run on the calling thread instead of a pool
# per process that competes for both cores. FEDJAX_HET_TEST_THREADS=pool keeps XLA's default pool. (Not the
# recipe's `intra_op_parallelism_threads=1`: a token without "--" makes XLA ignore every flag after it, such as
# fedjax_het's own and test_sharding's device count.)
if os.environ.get('FEDJAX_HET_TEST_THREADS', 'one') == 'one':
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_multi_thread_eigen=false').strip()

import jax

# Many tests build federations of the same tiny shapes; XLA's persistent compilation cache lets every test after
# the first reuse a compiled computation with the same HLO instead of compiling it again (compilation dominates
# these tests on CPU). FEDJAX_HET_TEST_CACHE=0 turns it off; FEDJAX_HET_TEST_CACHE=DIR keeps it in DIR. Otherwise
# the first process (pytest, or pytest-xdist's controller, which starts its workers after loading this file)
# makes a temporary folder, hands it to its workers through the environment, and removes it at exit.
_cache = os.environ.get('FEDJAX_HET_TEST_CACHE', '')
if _cache != '0':
  if not _cache:
    _cache = tempfile.mkdtemp(prefix='fedjax_het_xla_cache_')
    os.environ['FEDJAX_HET_TEST_CACHE'] = _cache
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache  # experiment subprocesses share it (not ~/.cache)
  jax.config.update('jax_compilation_cache_dir', _cache)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)

import numpy as np
import pytest

from fedjax_het.data import make_federated_data, make_synthetic


# The longest test files, started first (longest-processing-time order): pytest-xdist hands each worker whole files
# in collection order, so a long file collected last would keep one worker busy after the other has finished.
LONGEST_FIRST = ('test_golden.py', 'test_engine.py', 'test_experiment.py', 'test_dp.py', 'test_seed_baselines.py',
                 'test_models.py', 'test_reliability.py', 'test_flower.py', 'test_felo.py', 'test_fedvtc.py',
                 'test_sharding.py', 'test_phases.py', 'test_onednn.py', 'test_dp_release.py', 'test_poisson.py',
                 'test_conv.py', 'test_generators.py', 'test_fedgkt.py', 'test_pallas_conv.py', 'test_inversion.py',
                 'test_baselines.py', 'test_torch_baselines.py', 'test_multiprocess.py', 'test_gefl_f.py')


def pytest_collection_modifyitems(config, items):
  rank = lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST)
  items.sort(key=rank)  # stable: the order within and among the other files is kept


@pytest.fixture(autouse=True, scope='module')
def release_compiled_programs():
  """Drops every compiled program after each test module. An XLA:CPU executable holds dozens of memory mappings;
  a worker keeping all of the suite's reaches the kernel's limit (vm.max_map_count, 65,530) and segfaults inside
  XLA. Modules rarely share programs, and the persistent cache serves the few they do."""
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope='session')
def tiny_data():
  """A small learnable 8x8x1 dataset over 6 clients (Dirichlet 0.5), shared by engine/algorithm tests."""
  ds = make_synthetic(num_samples=480, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1)
  return make_federated_data(ds, num_clients=6, partition='dirichlet', seed=3, alpha=0.5)


@contextlib.contextmanager
def compilations():
  """Yields a list that collects the name (`jit(<function>)`) of every program XLA compiles inside the block."""
  names = []
  listener = lambda event, duration, fun_name='', **kw: names.append(fun_name) if 'backend_compile' in event else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield names
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def tree_allclose(a, b, **kw):
  import jax
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)

