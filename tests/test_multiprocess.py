"""A run over 2 JAX processes (2 CPU devices each, joined by `fedjax_het.launch` through gloo) equals the same run
in one process over 4 devices: every round's metrics and the final state, with partial and full participation;
a process killed mid-run stops the run, and --resume across 2 processes ends where the uninterrupted run ends."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, 'tests', 'multiprocess_driver.py')

# Round 1 draws half of the clients, rounds 2-3 all of them (--full_participation_rounds); the group of 8 clients
# lies over the 4-device 'clients' mesh, 2 clients per device, 4 in each process.
FLAGS = ['--dataset=digits', '--num_clients=8', '--models=mlp', '--feature_dim=16', '--rounds=3', '--join_ratio=0.5',
         '--full_participation_rounds=2', '--batch_size=16', '--strategy=vmap', '--checkpoint_every=1',
         '--noprogress']


def _env(**extra) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''), **extra)
  env.pop('JAX_NUM_CPU_DEVICES', None)
  return env


def one_process(workdir, algorithm: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, DRIVER, f'--algorithm={algorithm}', f'--workdir={workdir}'] + FLAGS,
                        env=_env(JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES='4'), capture_output=True, text=True,
                        timeout=600, cwd=ROOT)


def two_processes(workdir, algorithm: str, *extra: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'fedjax_het.launch', '--num_processes=2', '--cpu_devices=2',
                         f'--log_dir={workdir}_logs', DRIVER, f'--algorithm={algorithm}', f'--workdir={workdir}',
                         *FLAGS, *extra], env=_env(**env), capture_output=True, text=True, timeout=600, cwd=ROOT)


def _ok(proc: subprocess.CompletedProcess) -> None:
  assert proc.returncode == 0, f'exit {proc.returncode}; stderr:\n{proc.stderr[-4000:]}'


def metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [{k: v for k, v in json.loads(line).items() if 'seconds' not in k} for line in f]


def final_state(workdir) -> dict:
  """The leaves of the last checkpoint's state, as saved."""
  import orbax.checkpoint as ocp
  manager = ocp.CheckpointManager(os.path.join(str(workdir), 'checkpoints'))
  step = manager.latest_step()
  return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']


def assert_same_run(a, b) -> None:
  rows_a, rows_b = metrics(a), metrics(b)
  assert [r['round'] for r in rows_a] == [1, 2, 3] and [r['participants'] for r in rows_a] == [4, 8, 8]
  for ra, rb in zip(rows_a, rows_b, strict=True):
    assert ra.keys() == rb.keys()
    for k in ra:
      if isinstance(ra[k], (str, list)) or k == 'round':
        np.testing.assert_equal(ra[k], rb[k], err_msg=k)
      else:
        np.testing.assert_allclose(ra[k], rb[k], rtol=1e-5, atol=1e-6, err_msg=f'round {ra["round"]}: {k}')
  sa, sb = final_state(a), final_state(b)
  assert sa.keys() == sb.keys()
  for k in sa:
    np.testing.assert_allclose(sa[k], sb[k], rtol=1e-5, atol=1e-6, err_msg=f'state leaf {k}')


@pytest.mark.parametrize('algorithm', ['fedavg', 'fedre'])
def test_two_processes_equal_one(tmp_path, algorithm):
  one, two = tmp_path / 'one', tmp_path / 'two'
  _ok(one_process(one, algorithm))
  if algorithm == 'fedre':  # process 1 dies as round 3 starts; the launcher stops process 0 and fails
    killed = two_processes(two, algorithm, FEDJAX_HET_TEST_KILL_AT_ROUND='3')
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert 'process 1 of 2 exited with status -9' in killed.stderr
    assert [r['round'] for r in metrics(two)] == [1, 2] and not (two / 'summary.json').exists()
    _ok(two_processes(two, algorithm, '--resume'))
  else:
    _ok(two_processes(two, algorithm))
    # outputs are written once, by process 0; the others print nothing of the summary
    assert not any(name.endswith('.tmp') for name in os.listdir(two))
  assert_same_run(two, one)
  summary = json.loads((two / 'summary.json').read_text())
  assert summary['finished'] and summary['rounds'] == 3
