"""Sharding the client axis over several (host) devices gives the one-device results.

XLA's host device count is fixed when JAX starts, so each check runs in a fresh interpreter with
--xla_force_host_platform_device_count=4.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent('''
    import jax, numpy as np
    assert len(jax.devices()) == 4, jax.devices()
    from fedjax_het.algorithms import FedREConfig, fedavg_grouped, fedre
    from fedjax_het.data import make_federated_data, make_synthetic
    from fedjax_het.engine import Federation, LocalTraining, client_mesh

    ds = make_synthetic(num_samples=360, image_shape=(8, 8, 1), num_classes=4, noise=0.3, seed=1)
    data = make_federated_data(ds, num_clients=6, partition='dirichlet', seed=0, alpha=0.5)

    def run(algorithm, mesh, rounds=2, **kw):
      fed = Federation(algorithm, data, ['small_cnn_narrow', 'mlp'], LocalTraining(0.05, 8, 2), feature_dim=16,
                       strategy='vmap', eval_batch_size=16, conv='xla', client_mesh=mesh, **kw)
      state = fed.init()
      history = []
      for _ in range(rounds):
        state, m = fed.round(state)
        m.update(fed.evaluate(state))
        history.append({k: v for k, v in m.items() if 'seconds' not in k})
      return fed, state, history

    def same(a, b):
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
''')


def run_with_four_devices(body: str) -> str:
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4', JAX_PLATFORMS='cpu',
             PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  proc = subprocess.run([sys.executable, '-c', PRELUDE + textwrap.dedent(body)], env=env, capture_output=True,
                        text=True, timeout=600, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


@pytest.mark.parametrize('algorithm,kw', [('fedre(FedREConfig(), 4)', {}),
                                          ('fedre(FedREConfig(), 4)', {'join_ratio': 0.5}),
                                          ('fedre(FedREConfig(), 4)', {'join_ratio': 0.5, 'chunk_size': 4}),
                                          ('fedavg_grouped(4)', {})])
def test_sharded_over_four_devices_equals_one_device(algorithm, kw):
  out = run_with_four_devices(f'''
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
      print('ok', h4[-1]['accuracy'])
  ''')
  assert out.startswith('ok')


def test_sharded_experiment_checkpoints_and_resumes(tmp_path):
  out = run_with_four_devices(f'''
      import dataclasses, json
      from fedjax_het.config import ExperimentConfig
      from fedjax_het.experiment import train_and_evaluate
      cfg = ExperimentConfig(dataset='synthetic:8,8,1', num_clients=6, models=('small_cnn_narrow', 'mlp'),
                             strategy='vmap', rounds=2, batch_size=8, checkpoint_every=1, eval_batch_size=16,
                             feature_dim=16, num_devices=0, conv='xla')
      train_and_evaluate(cfg, {str(tmp_path / 'a')!r}, progress=False)
      full = train_and_evaluate(dataclasses.replace(cfg, rounds=3), {str(tmp_path / 'b')!r}, progress=False)
      resumed = train_and_evaluate(dataclasses.replace(cfg, rounds=3), {str(tmp_path / 'a')!r}, resume=True,
                                   progress=False)
      assert abs(full['final_accuracy'] - resumed['final_accuracy']) < 1e-9, (full, resumed)
      print('ok')
  ''')
  assert out.startswith('ok')
