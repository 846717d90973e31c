"""Sharding the client axis over several (host) devices gives the one-device results.

XLA's host device count is fixed when JAX starts, so the checks run in one fresh interpreter with
--xla_force_host_platform_device_count=4.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent('''
    import jax, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    from fedjax_het.methods import FedREConfig, fedre
    from fedjax_het.data import make_federated_data, make_synthetic
    from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig, client_mesh

    ds = make_synthetic(num_samples=360, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1)
    data = make_federated_data(ds, num_clients=6, partition='dirichlet', seed=0, alpha=0.5)

    def run(algorithm, mesh, rounds=2, **kw):
      chunk = kw.pop('chunk_size', 0)
      fed = Federation(algorithm, data, ModelConfig(['small_cnn_narrow', 'mlp'], 16), LocalTraining(0.05, 8, 2),
                       ExecutionConfig('vmap', 'xla', mesh, chunk, eval_batch_size=16), **kw)
      state = fed.init()
      history = []
      for _ in range(rounds):
        state, m = fed.round(state)
        m.update(fed.evaluate(state))
        history.append({k: v for k, v in m.items() if 'seconds' not in k})
      return fed, state, history

    SHARDED = {}  # case -> (its 4-device federation, final state)

    def same(a, b):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
''')


# Full participation over 4 devices is checked against one device across 2 processes (tests/test_multiprocess.py).
CASES = {
    'fedre_partial_chunked': ('fedre(FedREConfig(), 4)', {'join_ratio': 0.5, 'chunk_size': 4, 'rounds': 1}),
}


def equality_check(name: str, algorithm: str, kw: dict) -> str:
  return textwrap.dedent(f'''
      fed1, s1, h1 = run({algorithm}, None, **{kw!r})
      fed4, s4, h4 = run({algorithm}, client_mesh(4), **{kw!r})
      # 3 clients per group, padded to 4 on the 'clients' axis: one phantom slot per group.
      assert [g.stacked_size for g in fed4.groups] == [4, 4] and [g.stacked_size for g in fed1.groups] == [3, 3]
      for stacked in s4.groups:
        for leaf in jax.tree.leaves(stacked):
          assert len(leaf.sharding.device_set) == 4, leaf.sharding
      same([g[:3] for g in jax.tree.leaves(s4.groups)], jax.tree.leaves(s1.groups))
      same(s4.server, s1.server)
      for a, b in zip(h4, h1):
        assert a.keys() == b.keys()
        for k in a:
          if isinstance(a[k], str):
            assert a[k] == b[k], k
          else:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
      SHARDED[{name!r}] = fed4, s4
      print('ok {name}', flush=True)
  ''')


def checkpoint_check(workdir: str) -> str:
  """A sharded state saved and restored (`Checkpoints`, as --resume does) comes back sharded over the 4 devices,
  equal, and its next round equals the next round of the state that was saved; --num_devices=0 of the experiment
  layer lays a federation over every device."""
  return textwrap.dedent(f'''
      from fedjax_het.run.checkpoints import Checkpoints
      from fedjax_het.run.config import ExperimentConfig
      from fedjax_het.run.experiment import build_federation
      cfg = ExperimentConfig(dataset='synthetic:8,8,1', num_clients=6, models=('small_cnn_narrow', 'mlp'),
                             strategy='vmap', num_devices=0, feature_dim=16)
      assert build_federation(cfg).execution.num_devices == 4
      fed, saved = SHARDED['fedre_partial_chunked']
      checkpoints = Checkpoints({workdir!r})
      checkpoints.save(saved)
      restored = checkpoints.restore(fed.init(), int(saved.round))
      for leaf in jax.tree.leaves(restored.groups):
        assert len(leaf.sharding.device_set) == 4, leaf.sharding
      same(restored, saved)
      after_restore, m_restored = fed.round(restored)
      after_saved, m_saved = fed.round(saved)
      same(after_restore, after_saved)
      assert {{k: v for k, v in m_restored.items() if 'seconds' not in k}} == {{
          k: v for k, v in m_saved.items() if 'seconds' not in k}}
      print('ok checkpoint', flush=True)
  ''')


@pytest.fixture(scope='module')
def four_device_run(tmp_path_factory):
  """Every sharding check in ONE fresh interpreter with 4 host devices (an interpreter per check spent most of
  its time starting JAX and compiling the same one-device computations again). Returns (stdout, stderr)."""
  body = ''.join(equality_check(name, *case) for name, case in CASES.items())
  body += checkpoint_check(str(tmp_path_factory.mktemp('sharded_checkpoints')))
  flags = os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=4'
  env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS='cpu',
             PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  cache = jax.config.jax_compilation_cache_dir
  prelude = PRELUDE if not cache else (
      f'import jax\njax.config.update("jax_compilation_cache_dir", {cache!r})\n'
      'jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)\n'
      'jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)\n' + PRELUDE)
  proc = subprocess.run([sys.executable, '-c', prelude + body], env=env, capture_output=True, text=True,
                        timeout=1200, cwd=ROOT)
  return proc.stdout, proc.stderr


def _check(run, name):
  out, err = run
  assert f'ok {name}' in out.splitlines(), f'check {name!r} did not pass; stderr:\n{err[-4000:]}'


@pytest.mark.parametrize('name', sorted(CASES))
def test_sharded_over_four_devices_equals_one_device(four_device_run, name):
  _check(four_device_run, name)


def test_sharded_experiment_checkpoints_and_resumes(four_device_run):
  _check(four_device_run, 'checkpoint')
