"""A run over 2 JAX processes (2 CPU devices each, joined by `fedjax_het.run.launch` through gloo) equals the same run
in one process on one device: every round's metrics and the final state, with partial and full participation
and phantom slots padding the group to the 4 devices; a process killed mid-run stops the run, and --resume across
2 processes ends where the uninterrupted run ends. The launcher itself: environment, signals, failures."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, 'tests', 'multiprocess_driver.py')

# Round 1 draws half of the clients, round 2 all of them (--full_participation_rounds); the group of 6 clients
# lies over the 4-device 'clients' mesh padded to 8 slots (2 phantom copies of its last client), 4 per process.
FLAGS = ['--dataset=digits', '--num_clients=6', '--models=mlp', '--feature_dim=16', '--rounds=2', '--join_ratio=0.5',
         '--full_participation_rounds=1', '--batch_size=16', '--strategy=vmap', '--checkpoint_every=1',
         '--noprogress']


def _env(**extra) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''), **extra)
  env.pop('JAX_NUM_CPU_DEVICES', None)
  return env


def one_process(workdir, algorithm: str) -> None:
  """The same flags in this process, on its one device."""
  from absl import flags
  from fedjax_het.run import cli
  from fedjax_het.run.experiment import train_and_evaluate
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['test', f'--algorithm={algorithm}'] + FLAGS, fv)
  train_and_evaluate(cli.config_from_flags(fv), str(workdir), progress=False)


def two_processes(workdir, algorithm: str, *extra: str, **env) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', 'fedjax_het.run.launch', '--num_processes=2', '--cpu_devices=2',
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
  assert [r['round'] for r in rows_a] == [1, 2] and [r['participants'] for r in rows_a] == [3, 6]
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
    x, y = sa[k], sb[k]
    if x.shape != y.shape:  # a stacked client leaf: 8 slots over the devices, the last 2 phantom, 6 on one device
      assert x.shape[0] == 8 and y.shape == (6,) + x.shape[1:], (k, x.shape, y.shape)
      x = x[:6]
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f'state leaf {k}')


# Both run with -m slow (CI's suite budget): grouped FedAvg's, and FedRE's with the kill and the resume. Processes
# joined by the launcher run in the default suite (test_the_launchers_terminal_holds_the_runs_lines_and_gloos_report_
# goes_to_the_log), and test_layers.py checks that no import initialises a backend before the join.
@pytest.mark.parametrize('algorithm', [pytest.param('fedavg', marks=pytest.mark.slow),
                                       pytest.param('fedre', marks=pytest.mark.slow)])
def test_two_processes_equal_one(tmp_path, algorithm):
  one, two = tmp_path / 'one', tmp_path / 'two'
  one_process(one, algorithm)
  if algorithm == 'fedre':  # process 1 dies as round 2 starts; the launcher stops process 0 and fails
    killed = two_processes(two, algorithm, FEDJAX_HET_TEST_KILL_AT_ROUND='2')
    assert killed.returncode == 137, killed.stderr[-3000:]
    assert 'process 1 of 2 exited with status -9' in killed.stderr
    assert [r['round'] for r in metrics(two)] == [1] and not (two / 'summary.json').exists()
    _ok(two_processes(two, algorithm, '--resume'))
  else:
    _ok(two_processes(two, algorithm))
    # outputs are written once, by process 0; the others print nothing of the summary
    assert not any(name.endswith('.tmp') for name in os.listdir(two))
  assert_same_run(two, one)
  summary = json.loads((two / 'summary.json').read_text())
  assert summary['finished'] and summary['rounds'] == 2


SCRIPT = '''
import os, signal, sys, time
from fedjax_het.run.distributed import NUM_PROCESSES, PROCESS_ID, COORDINATOR
index = os.environ[PROCESS_ID]
print(f'process {index} of {os.environ[NUM_PROCESSES]} at {os.environ[COORDINATOR]}, argv {sys.argv[1:]}',
      flush=True)
signal.signal(signal.SIGINT, lambda s, f: (print(f'process {index}: SIGINT', flush=True), sys.exit(130)))
if sys.argv[1] == 'fail' and index == '1':
  sys.exit(3)
time.sleep(60)
'''


def _launch(tmp_path, mode: str, interrupt: bool = False) -> subprocess.CompletedProcess:
  import signal
  import time
  script = tmp_path / 'script.py'
  script.write_text(SCRIPT)
  proc = subprocess.Popen([sys.executable, '-m', 'fedjax_het.run.launch', '--num_processes=2',
                           f'--log_dir={tmp_path / "logs"}', str(script), mode], env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
  if interrupt:
    log = tmp_path / 'logs' / 'process_1.log'
    while not (log.exists() and 'process 1' in log.read_text()):
      time.sleep(0.05)
    time.sleep(0.5)  # both have installed their handlers
    proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=60)
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_launcher_starts_joined_processes_forwards_a_stop_and_stops_the_rest_on_a_failure(tmp_path):
  """Each process gets the entry point's arguments plus --distributed and its index; a SIGINT reaches every
  process once; a failed process stops the others and its status and log end are the launcher's."""
  stopped = _launch(tmp_path, 'wait', interrupt=True)
  assert stopped.returncode == 130, stopped.stderr
  assert "process 0 of 2 at 127.0.0.1:" in stopped.stdout and "argv ['wait', '--distributed']" in stopped.stdout
  assert stopped.stdout.count('SIGINT') == 1
  log = (tmp_path / 'logs' / 'process_1.log').read_text()
  assert 'process 1 of 2' in log and log.count('SIGINT') == 1
  failed = _launch(tmp_path, 'fail')
  assert failed.returncode == 3
  assert 'process 1 of 2 exited with status 3; stopped the others' in failed.stderr


def test_a_run_over_several_processes_lays_groups_over_all_their_devices(monkeypatch):
  """With several processes the default strategy is vmap over every device; a sequential strategy, a mesh of some
  devices only or a convolution the machine cannot run is refused, naming the flag."""
  import jax
  from fedjax_het.run.config import ExperimentConfig
  from fedjax_het.errors import ConfigError
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  execution = ExperimentConfig(models=('mlp',)).execution_config().resolve()
  assert execution.strategy == 'vmap' and execution.num_devices == len(jax.devices())
  with pytest.raises(ConfigError, match=r"--strategy='sequential' runs a group on one device"):
    ExperimentConfig(strategy='sequential').execution_config()
  if len(jax.devices()) == 1:
    with pytest.raises(ConfigError, match=r'--num_devices=2: a run of 2 processes'):
      ExperimentConfig(num_devices=2).execution_config()
  # a convolution this machine cannot run is refused here, before any process loads data
  from fedjax_het.kernels import onednn
  monkeypatch.setattr(onednn, 'unavailable_reason', lambda: 'oneDNN is not installed. Fix: pip install ...')
  with pytest.raises(ConfigError, match=r"conv='onednn': oneDNN is not installed"):
    ExperimentConfig(conv='onednn').execution_config()


def test_the_coordinator_listens_on_the_address_it_is_given_only(monkeypatch):
  """JAX's coordination service is unauthenticated and by default listens on every interface; the run binds it to
  the coordinator address the processes are given (or FEDJAX_HET_COORDINATOR_BIND_ADDRESS)."""
  import jax
  from fedjax_het.run import distributed
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: calls.append((a, k)))
  monkeypatch.setenv(distributed.COORDINATOR, '127.0.0.1:4321')
  monkeypatch.setenv(distributed.NUM_PROCESSES, '2')
  monkeypatch.setenv(distributed.PROCESS_ID, '0')
  distributed.initialize()
  monkeypatch.setenv(distributed.COORDINATOR_BIND, '10.0.0.5:4321')
  distributed.initialize()
  assert [(a, k['coordinator_bind_address']) for a, k in calls] == [
      (('127.0.0.1:4321', 2, 0), '127.0.0.1:4321'), (('127.0.0.1:4321', 2, 0), '10.0.0.5:4321')]


def test_the_processes_end_with_a_killed_launcher_and_its_logs_go_to_the_workdir(tmp_path):
  """kill -9 of the launcher once left its processes running on silently; now the kernel sends them SIGTERM. With
  --workdir in the command the logs of processes 1.. go to WORKDIR/process_logs, not the system's temp folder; a
  --port in use is one clear line before anything starts."""
  import signal
  import socket
  import time
  script = tmp_path / 'script.py'
  script.write_text(SCRIPT.replace("time.sleep(60)", "open(f'{sys.argv[2]}/pid_{index}', 'w').write(str(os.getpid()))"
                                                       "\ntime.sleep(60)"))
  (tmp_path / 'run').mkdir()
  launcher = subprocess.Popen([sys.executable, '-m', 'fedjax_het.run.launch', '--num_processes=2', str(script), 'wait',
                               str(tmp_path), f'--workdir={tmp_path / "run"}'], env=_env(), cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  pids = [tmp_path / f'pid_{i}' for i in range(2)]
  deadline = time.monotonic() + 60
  while not all(p.exists() and p.read_text() for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  children = [int(p.read_text()) for p in pids]
  assert 'process 1 of 2' in (tmp_path / 'run' / 'process_logs' / 'process_1.log').read_text()
  launcher.send_signal(signal.SIGKILL)
  launcher.wait()
  deadline = time.monotonic() + 20
  alive = children
  while alive and time.monotonic() < deadline:
    time.sleep(0.1)
    alive = [pid for pid in children if os.path.exists(f'/proc/{pid}') and
             open(f'/proc/{pid}/stat').read().split()[2] != 'Z']
  assert not alive, f'processes {alive} outlived their launcher'
  with socket.socket() as busy:
    busy.bind(('127.0.0.1', 0))
    busy.listen()
    port = busy.getsockname()[1]
    done = subprocess.run([sys.executable, '-m', 'fedjax_het.run.launch', f'--port={port}', str(script), 'wait'],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1].endswith(
      f'error: --port={port}: something on this machine listens on 127.0.0.1:{port} already. Fix: another --port, '
      f'or leave it out (a free one is chosen).')


JOINED = '''
from fedjax_het.run import distributed
distributed.initialize()
distributed.barrier('joined')  # the first collective: gloo connects the processes and prints its report
import jax
print(f'process {jax.process_index()} joined', flush=True)
'''


def test_the_launchers_terminal_holds_the_runs_lines_and_gloos_report_goes_to_the_log(tmp_path, monkeypatch, capfd):
  """gloo prints '[Gloo] Rank 0 is connected to 1 peer ranks...' on stdout from C++ as the processes first
  connect; the launcher keeps that line to process 0's log and relays the rest of process 0's output."""
  from fedjax_het.run import launch
  script = tmp_path / 'joined.py'
  script.write_text(JOINED)
  monkeypatch.setenv('PYTHONPATH', ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  assert launch.launch([str(script)], 2, cpu_devices=1, log_dir=str(tmp_path / 'logs')) == 0
  out, err = capfd.readouterr()
  assert 'process 0 joined' in out
  assert '[Gloo]' not in out + err, out + err
  log = (tmp_path / 'logs' / 'process_0.log').read_text()
  assert '[Gloo] Rank 0 is connected to 1 peer ranks' in log and 'process 0 joined' in log
