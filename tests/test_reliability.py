"""Workdir protection, input validation, bad checkpoints and signals (the findings of the reliability issue).

Each failure mode is checked in process where possible, failing before any compilation; the runs that must train
use the tiny setting of tests/test_experiment.py, whose computations the compilation cache already holds.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from fedjax_het.data.datasets import load_npz
from fedjax_het.errors import ConfigError
from fedjax_het.run import interrupts
from fedjax_het.run.checkpoints import CheckpointError, Checkpoints
from fedjax_het.run.experiment import train_and_evaluate
from fedjax_het.run.workdir import Workdir

from runs import CFG, FAULT_RUNS, metric_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """An uninterrupted run of CFG (checkpoints at rounds 2 and 4), read-only for the tests."""
  path = str(tmp_path_factory.mktemp('finished'))
  train_and_evaluate(CFG, path, progress=False)
  return path


# ------------------------------------------------------------------ 1, 2: the workdir and the run's identity
def test_a_second_process_cannot_use_a_workdir_in_use(tmp_path):
  with Workdir(str(tmp_path)).open(resume=False):
    with pytest.raises(ConfigError, match='in use by a running run'):
      train_and_evaluate(CFG, str(tmp_path), progress=False)
  assert os.listdir(tmp_path) == ['.lock']  # nothing else written


def test_resume_checks_the_checkpoints_identity_even_without_config_json(finished, tmp_path):
  run = str(tmp_path / 'run')
  os.makedirs(run)
  os.symlink(os.path.join(finished, 'checkpoints'), os.path.join(run, 'checkpoints'))
  with pytest.raises(ConfigError, match=r"different settings for seed \(0 there, 1 now\)"):
    train_and_evaluate(dataclasses.replace(CFG, seed=1), run, resume=True, progress=False)


def test_a_save_that_does_not_land_is_an_error(finished, tmp_path):
  import shutil
  shutil.copytree(os.path.join(finished, 'checkpoints'), tmp_path / 'checkpoints')
  checkpoints = Checkpoints(str(tmp_path / 'checkpoints'))
  state = checkpoints.restore(_template(), 4)
  with pytest.raises(CheckpointError, match='already holds one at round 4'):
    checkpoints.save(state._replace(round=state.round - 2))


def _template():
  from fedjax_het.run.experiment import build_federation
  return build_federation(CFG).init()


def test_rounds_may_change_on_resume_only_when_the_method_ignores_them():
  from fedjax_het.run.experiment import _check_identity
  from fedjax_het.data import PublicData
  from fedjax_het.run.registry import METHODS, Run
  reads = {}
  for name, m in METHODS.items():
    run = Run(10, 4, 20, 512, lambda: np.ones(10),
              PublicData(np.zeros((4, 8, 8, 1), np.float32), np.arange(4) % 10, 'public'))
    m.algorithm(m.config(), run)
    reads[name] = run.depends_on_rounds
  # FedKD's energy schedule spans --rounds; FedVTC's closing phases come after round --rounds; GeFL's and GeFL-F's
  # target phase is --rounds long after their knowledge (and warm-up) phases; Felo's family warms up for and decays
  # its rate at shares of --rounds
  assert [name for name, read in reads.items() if read] == ['fedkd', 'fedvtc', 'gefl', 'gefl_f', 'felo', 'velo',
                                                            'fedhe']
  run = Run(10, 4, 20, 16, None)
  run.rounds  # noqa: B018 (the read is the point)
  with pytest.raises(ConfigError, match='--rounds=20'):
    _check_identity({'settings': {'rounds': 10}, 'partition': 'p'}, {'settings': {'rounds': 20}, 'partition': 'p'},
                    'here', run)


# ------------------------------------------------------------------ 3: damaged checkpoints and metrics
def test_resume_falls_back_past_an_unreadable_checkpoint_and_a_torn_metrics_line(finished, tmp_path):
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  for root, _, files in os.walk(os.path.join(run, 'checkpoints', '4')):
    for name in files:
      open(os.path.join(root, name), 'w').close()  # every file of the newest checkpoint emptied
  with open(os.path.join(run, 'metrics.jsonl'), 'a') as f:
    f.write('{"round": 5, "train_lo')  # a torn last line
  train_and_evaluate(CFG, run, resume=True, progress=False)
  assert metric_rows(run) == metric_rows(finished)
  assert os.listdir(os.path.join(run, 'checkpoints.unreadable')) == ['4']  # kept aside, not deleted


def test_the_cause_of_a_failed_write_is_the_systems_words_from_an_os_error_or_orbaxs_message():
  from fedjax_het.run.checkpoints import _cause
  assert _cause(OSError(28, 'No space left on device')) == 'No space left on device'
  assert _cause(ValueError("RESOURCE_EXHAUSTED: Failed to write 9 bytes to file 19 [os_error_code='13']")) == (
      'Permission denied')
  assert _cause(RuntimeError('first line\nsecond')) == 'first line'


# A plain OSError in the whole run: -m slow (its cause, above, by default).
@pytest.mark.parametrize('error', [
    pytest.param(OSError(28, 'No space left on device'), marks=pytest.mark.slow),
    ValueError('RESOURCE_EXHAUSTED: Error writing "5/0.0.0" in OCDBT database at local file "x": Failed to write '
               "4489216 bytes to file 19: No space left on device [os_error_code='28']"),  # orbax's tensorstore
])
def test_a_full_disk_during_a_checkpoint_is_one_clear_error_and_keeps_the_summary(tmp_path, monkeypatch, error):
  """As orbax fails on a full disk: it raises while tensorstore's writes are still in flight, which go on writing
  into the temporary folder and then call back into orbax's closed event loop ('Event loop is closed', printed as a
  traceback each by Python's unraisable hook)."""
  import threading
  import time
  import orbax.checkpoint as ocp
  cfg = dataclasses.replace(CFG, rounds=4)
  original = ocp.CheckpointManager.save

  class LateCallback:
    def __del__(self):
      raise RuntimeError('Event loop is closed')

  def writes_in_flight(folder):
    for i in range(6):
      time.sleep(0.05)
      LateCallback()  # unraisable, as tensorstore's callbacks are
      try:
        os.makedirs(os.path.join(folder, 'state', 'd'), exist_ok=True)
        open(os.path.join(folder, 'state', 'd', str(i)), 'w').close()
      except OSError:  # removed meanwhile, between two of the folders made
        pass

  def no_space(self, step, *args, **kwargs):
    if step < 4:
      return original(self, step, *args, **kwargs)
    folder = os.path.join(self.directory, f'{step}.orbax-checkpoint-tmp')
    os.makedirs(os.path.join(folder, 'state'))  # the write had begun
    threading.Thread(target=writes_in_flight, args=(folder,)).start()
    raise error
  monkeypatch.setattr(ocp.CheckpointManager, 'save', no_space)
  printed = []  # what Python's unraisable hook would print, a traceback each
  monkeypatch.setattr(sys, 'unraisablehook', lambda unraisable: printed.append(str(unraisable.exc_value)))
  with pytest.raises(CheckpointError, match=r'round 4 could not be written .*\(No space left on device\)\. Fix the '
                                            r'cause \(free disk space\), then continue from the checkpoint of round 2 '
                                            r'with --resume'):
    train_and_evaluate(cfg, str(tmp_path), progress=False)
  assert json.load(open(tmp_path / 'summary.json'))['rounds'] == 4
  time.sleep(0.5)  # past the writes in flight
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['2']  # the partial write is gone, and stays gone
  assert printed == []


def test_a_checkpoint_folder_that_cannot_be_written_fails_at_once(tmp_path):
  """orbax's writer would wait five minutes for a step folder it cannot make, then print thread tracebacks."""
  (tmp_path / 'run').mkdir()
  (tmp_path / 'run' / 'checkpoints').write_text('')  # unwritable as a folder, even for root
  with pytest.raises(CheckpointError, match='checkpoints cannot be written .* Fix: make it writable, or choose '
                                            'another --workdir'):
    train_and_evaluate(CFG, str(tmp_path / 'run'), progress=False)


def test_resume_rebuilds_a_deleted_metrics_file_from_the_checkpoint(finished, tmp_path):
  """metrics.jsonl deleted (or cut short) in a finished run: --resume takes the rows saved with the checkpoint, so
  the history and the summary are the run's, not those of the rounds run after the resume."""
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  os.remove(os.path.join(run, 'metrics.jsonl'))
  summary = train_and_evaluate(CFG, run, resume=True, progress=False)
  assert metric_rows(run) == metric_rows(finished)
  assert summary['second_half_mean_accuracy'] == json.load(open(os.path.join(finished, 'summary.json')))[
      'second_half_mean_accuracy']


def test_resume_refuses_a_history_it_cannot_rebuild(finished, tmp_path, monkeypatch):
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  with open(os.path.join(run, 'metrics.jsonl')) as f:
    lines = f.readlines()
  with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
    f.writelines(lines[2:])  # rounds 1 and 2 lost
  monkeypatch.setattr(Checkpoints, 'metrics', lambda self, step: None)  # a checkpoint without a copy of the rows
  with pytest.raises(ConfigError, match='holds 2 of the 4 rounds the checkpoint follows, and the checkpoint carries '
                                        'no copy'):
    train_and_evaluate(CFG, run, resume=True, progress=False)


def test_a_full_disk_without_checkpoints_says_how_to_start_again_not_to_resume(tmp_path, monkeypatch):
  """--checkpoint_every=0 and metrics.jsonl cannot be appended: neither the error nor a --resume after it
  sends the user in a circle (resume -> 'drop --resume' -> 'add --resume')."""
  run = str(tmp_path / 'run')
  cfg = dataclasses.replace(CFG, rounds=2, checkpoint_every=0)

  def no_space(self, row):
    raise OSError(28, 'No space left on device')
  with monkeypatch.context() as patched:
    patched.setattr(Workdir, 'append_metrics', no_space)
    with pytest.raises(ConfigError, match='wrote no checkpoint.*start it again in a new --workdir') as error:
      train_and_evaluate(cfg, run, progress=False)
  assert '--resume' not in str(error.value)
  with pytest.raises(ConfigError, match='wrote no checkpoint.*cannot be continued.*new --workdir') as error:
    train_and_evaluate(cfg, run, resume=True, progress=False)
  assert 'drop --resume' not in str(error.value)


def test_resume_restores_even_with_checkpoint_every_zero(finished, tmp_path):
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  summary = train_and_evaluate(dataclasses.replace(CFG, checkpoint_every=0), run, resume=True, progress=False)
  assert summary['rounds'] == 4 and metric_rows(run) == metric_rows(finished)


# ------------------------------------------------------------------ 4, 8: data files
def _npz(tmp_path, **arrays):
  path = str(tmp_path / 'data.npz')
  np.savez(path, **arrays)
  return path


X = np.zeros((6, 4, 4), np.uint8)


@pytest.mark.parametrize('arrays,message', [
    (dict(x=X, y=np.array([0, 1, 2, -1, 0, 1])), 'negative labels'),
    (dict(x=X, y=np.array([0, 1, 0.5, 1, 0, 1])), 'non-integer labels'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0, 1]) + 2**32), r'labels up to 4294967299, beyond any class index'),
    (dict(x=X, y=np.array([0, 1, 2, 99, 0, 1])), 'no training sample'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0])), 'same number'),
    (dict(x=X[:0], y=np.zeros(0, int)), 'same number'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0, 1]), x_test=X), 'x_test without y_test'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0, 1]), x_test=np.zeros((2, 5, 5), np.uint8), y_test=np.zeros(2, int)),
     'test images have shape'),
    (dict(x=np.full((6, 4, 4), np.nan, np.float32), y=np.array([0, 1, 2, 3, 0, 1])), 'NaN or infinite pixels'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0, 1]), num_classes=np.array(3)), 'num_classes is 3'),
    (dict(x=X, y=np.array(['a'] * 6)), 'dtype <U1'),
    (dict(x=np.full((6, 4, 4), 3200, np.uint16), y=np.array([0, 1, 2, 3, 0, 1])),
     'x holds uint16 pixels from 3200 to 3200; integer images are read as 0..255'),
    (dict(x=np.full((6, 4, 4), 255.0, np.float32), y=np.array([0, 1, 2, 3, 0, 1])),
     'x holds float pixels up to 255 in magnitude; float images are used as they are'),
    (dict(x=X, y=np.array([0, 1, 2, 3, 0, 1]), num_classes=np.array([10, 11])),
     r'num_classes must be one positive integer .* got int64 of shape \(2,\)'),
])
def test_npz_files_are_checked_before_any_work(tmp_path, arrays, message):
  with pytest.raises(ConfigError, match=message):
    load_npz(_npz(tmp_path, **arrays))


def test_a_file_that_is_not_an_npz_is_named(tmp_path):
  path = tmp_path / 'data.npz'
  path.write_text('not a zip')
  with pytest.raises(ConfigError, match=r'not an \.npz file \(an \.npz is a zip archive'):
    load_npz(str(path))


def test_an_npz_with_a_num_classes_array_keeps_classes_without_samples(tmp_path):
  data = load_npz(_npz(tmp_path, x=X, y=np.array([0, 1, 0, 1, 0, 1]), num_classes=np.array(10)))
  assert data.num_classes == 10


def test_a_stray_label_that_adds_classes_is_reported(tmp_path, caplog):
  y = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 2 + [12])  # one stray 12 in 10-class data
  data = load_npz(_npz(tmp_path, x=np.zeros((21, 4, 4), np.uint8), y=y))
  assert data.num_classes == 13
  assert 'labels reach 12, so the data have 13 classes, 2 of them without a training sample ([10, 11])' in caplog.text


def test_a_resume_with_a_changed_hyperparameter_names_its_flag(finished, tmp_path):
  import shutil
  from fedjax_het.methods import FedREConfig
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  with pytest.raises(ConfigError, match=r'different settings for server_epochs \(1 there, 3 now\)\. Fix') as error:
    train_and_evaluate(dataclasses.replace(CFG, methods={'fedre': FedREConfig(server_epochs=3)}), run, resume=True,
                       progress=False)
  assert 'methods' not in str(error.value)


def test_integer_images_of_any_dtype_in_0_255_read_as_uint8(tmp_path):
  pixels = (np.arange(6 * 16) * 255 // 95).reshape(6, 4, 4)  # 0 .. 255
  as_uint16 = load_npz(_npz(tmp_path, x=pixels.astype(np.uint16), y=np.array([0, 1, 0, 1, 0, 1]))).x
  np.testing.assert_array_equal(as_uint16, load_npz(_npz(tmp_path, x=pixels.astype(np.uint8),
                                                          y=np.array([0, 1, 0, 1, 0, 1]))).x)
  assert as_uint16.min() == -1.0 and as_uint16.max() == 1.0  # 0 -> -1, 255 -> 1


# ------------------------------------------------------------------ 5, 8, 9: flags and settings
@pytest.mark.parametrize('changes,message', [
    (dict(batch_size=5000), '--batch_size=5000 is larger than every client'),
    (dict(chunk_size=-1), '--chunk_size=-1'),
    (dict(seed=-1), '--seed=-1'),
    (dict(alpha=float('nan')), '--alpha=nan'),
    (dict(num_clients=10000), '--num_clients=10000 is more than the 2500 samples'),
    (dict(local_learning_rate=float('nan')), '--local_learning_rate=nan'),
    (dict(feature_dim=10**12), '--feature_dim=1000000000000 must be between 1 and 65536'),  # was blamed on --models
    (dict(local_learning_rate=float('inf')), '--local_learning_rate=inf'),
    (dict(algorithm='fedtgp', methods={'fedtgp': __import__('fedjax_het.methods', fromlist=['x']).FedTGPConfig(
        margin_threshold=float('inf'))}), '--margin_threshold=inf'),
])
def test_bad_settings_fail_before_any_work_with_the_flag_named(tmp_path, changes, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
    train_and_evaluate(dataclasses.replace(CFG, **changes), str(tmp_path / 'run'), progress=False)
  assert not os.path.exists(tmp_path / 'run' / 'config.json')


def test_a_one_class_dataset_is_named_as_such(tmp_path):
  path = _npz(tmp_path, x=np.zeros((40, 4, 4), np.uint8), y=np.zeros(40, int))
  with pytest.raises(ConfigError, match='all belong to class'):
    train_and_evaluate(dataclasses.replace(CFG, dataset=f'npz:{path}'), str(tmp_path / 'run'), progress=False)


@pytest.mark.parametrize('kind', ['file', 'readonly', 'proc', 'dangling'])
def test_an_unusable_workdir_is_one_clear_error(tmp_path, kind):
  path = tmp_path / 'workdir'
  if kind == 'dangling':  # was "File exists"
    path.symlink_to(tmp_path / 'gone')
    message = r'is a symbolic link to .*gone, which does not exist\. Fix: create that folder'
  elif kind == 'proc':
    path = '/proc/fedjax_het_workdir'  # unwritable even for root
    message = 'cannot be written'
  elif kind == 'file':
    path.write_text('')
    message = 'is a file'
  else:
    path.mkdir()
    os.chmod(path, 0o500)
    if os.access(path, os.W_OK):
      pytest.skip('running as a user who can write anywhere (root)')
    message = 'cannot be written'
  with pytest.raises(ConfigError, match=message):
    train_and_evaluate(CFG, str(path), progress=False)


def test_clients_that_take_no_step_are_listed(tmp_path):
  from fedjax_het.engine.federation import Federation
  from fedjax_het.run.experiment import build_federation
  fed = build_federation(dataclasses.replace(CFG, alpha=0.05, batch_size=400))
  assert isinstance(fed, Federation)
  sizes = fed.train_sizes
  assert fed.clients_without_steps == [k for k in range(4) if sizes[k] < 400] != []


# ------------------------------------------------------------------ 6: signals
def test_sigterm_and_sigint_request_a_stop_and_a_second_one_aborts():
  with interrupts.StopAtRoundEnd() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested == 'SIGTERM'
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert interrupts.requested() is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_signal_during_startup_stops_before_anything_is_written(tmp_path, monkeypatch):
  import fedjax_het.run.experiment as experiment
  original = experiment.load_dataset

  def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return original(*args, **kwargs)
  monkeypatch.setattr(experiment, 'load_dataset', signalled)
  with pytest.raises(interrupts.Interrupted) as stopped:
    train_and_evaluate(CFG, str(tmp_path), progress=False)
  assert (stopped.value.rounds_done, stopped.value.resumable) == (0, False)
  assert os.listdir(tmp_path) == ['.lock']


def test_the_entry_point_stops_cleanly_on_a_signal_during_startup(tmp_path):
  args = [sys.executable, os.path.join(ROOT, 'experiments', 'fedre.py'), '--dataset=digits', '--rounds=1',
          '--models=mlp', f'--workdir={tmp_path}', '--progress=false']
  process = subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True)
  import time
  time.sleep(1.0)  # inside the imports
  process.send_signal(signal.SIGTERM)
  _, stderr = process.communicate(timeout=300)
  assert process.returncode == 143, stderr
  assert 'before the first round' in stderr and 'Traceback' not in stderr


def test_a_second_signal_aborts_at_once_while_the_main_thread_waits_inside_native_code():
  """The main thread held in native code (as while XLA compiles a large program) cannot run Python's signal
  handler; the entry points' watcher says at once that the stop was heard and, on the second signal, ends the
  process itself."""
  import time
  script = textwrap.dedent('''
      import ctypes, signal, sys
      from fedjax_het.run import interrupts
      interrupts.install(watch=True)
      # The main thread takes no signal at all, so nothing can wake it from the native call below.
      signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
      print('ready', flush=True)
      ctypes.CDLL(None).sleep(120)  # native code: Python's handler cannot run in this thread meanwhile
      print('woke', flush=True)
  ''')
  process = subprocess.Popen([sys.executable, '-c', script], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=ROOT),
                             start_new_session=True)  # no signal for the test's process group reaches it
  assert process.stdout.readline().strip() == 'ready'
  process.send_signal(signal.SIGTERM)
  heard = ''
  while 'SIGTERM: finishing this round' not in heard and process.poll() is None:
    heard += process.stderr.readline()
  start = time.monotonic()
  process.send_signal(signal.SIGTERM)
  out, stderr = process.communicate(timeout=60)
  assert process.returncode == 143 and 'aborted (SIGTERM): the last checkpoint stands' in stderr, (
      process.returncode, heard, out, stderr)
  assert time.monotonic() - start < interrupts.ABORT_GRACE_SECONDS + 10


# ------------------------------------------------------------------ kill -9 anywhere
# Each kill is a process of its own (about 9 s of the default run's CPU): the default run kills inside a checkpoint
# write and resumes; the slow set (`-m slow`) kills again halfway through a metrics line. What that kill leaves (a
# torn last line) is also written by hand in
# test_resume_falls_back_past_an_unreadable_checkpoint_and_a_torn_metrics_line.
@pytest.mark.parametrize('kills', [[('checkpoint', 4, False)],
                                   pytest.param([('checkpoint', 4, False), ('metrics', 3, True)],
                                                marks=pytest.mark.slow)], ids=['checkpoint', 'checkpoint_metrics'])
def test_kill_9_then_resume_gives_the_uninterrupted_metrics(finished, tmp_path, kills):
  """SIGKILL inside the checkpoint write of round 4 (its files written, not committed), then (slow set; resumed from
  round 2) halfway through the metrics line of round 3; resumed again, the run's metrics equal the uninterrupted
  run's. (A kill inside a round's computation leaves what the kill inside the checkpoint write leaves:
  tests/fault_driver.py 'round'.)"""
  run = str(tmp_path / 'run')
  driver = os.path.join(ROOT, 'tests', 'fault_driver.py')
  for point, round_, resume in kills + [('none', 0, True)]:
    result = subprocess.run([sys.executable, driver, run, point, str(round_)] + ['--resume'] * resume, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == (0 if point == 'none' else -signal.SIGKILL), (point, result.stderr[-2000:])
  assert metric_rows(run) == metric_rows(finished)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(FAULT_RUNS))
def test_kill_9_inside_a_phase_of_a_multi_phase_method_then_resume_gives_the_uninterrupted_metrics(tmp_path, name):
  """Each multi-phase method (GeFL with each generator and in update mode, GeFL-F, Felo, FedHe, FedVTC's
  fine-tuning round) killed with SIGKILL inside a round after a checkpoint of that phase, then resumed: its
  metrics equal those of the same run uninterrupted. (Slow: three processes each; `-m slow`.)"""
  driver = os.path.join(ROOT, 'tests', 'fault_driver.py')
  killed, whole = str(tmp_path / 'killed'), str(tmp_path / 'whole')
  kill_round = FAULT_RUNS[name][1]
  for workdir, point, resume in [(whole, 'none', False), (killed, 'round', False), (killed, 'none', True)]:
    result = subprocess.run([sys.executable, driver, workdir, point, str(kill_round), f'--run={name}'] +
                            ['--resume'] * resume, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == (-signal.SIGKILL if point == 'round' else 0), (point, result.stderr[-2000:])
    if point == 'round':
      assert len(metric_rows(killed)) == kill_round - 1  # it died inside the round, after the rows before
  assert metric_rows(killed) == metric_rows(whole)


STREAMED = {'fedre': (CFG, 4), 'felo': FAULT_RUNS['felo']}


@pytest.mark.parametrize('name', [pytest.param('felo', marks=pytest.mark.slow), pytest.param('fedre', marks=pytest.mark.slow)])
def test_a_streamed_run_resumes_after_kill_9_and_sigint_as_if_uninterrupted(tmp_path, monkeypatch, name):
  """Client states kept on the host (`--stream_clients`) are restored as host arrays: killed with SIGKILL inside a
  round, resumed and stopped by SIGINT inside the first resumed round, resumed again, the run's metrics equal the
  uninterrupted run's and no checkpoint is set aside (one-phase FedRE; Felo, whose resume crosses its phase
  boundary)."""
  import dataclasses
  from fedjax_het.engine.federation import Federation
  cfg, kill_round = STREAMED[name]
  cfg = dataclasses.replace(cfg, strategy='vmap', stream_clients=True)
  whole, killed = str(tmp_path / 'whole'), str(tmp_path / 'killed')
  train_and_evaluate(cfg, whole, progress=False)
  driver = os.path.join(ROOT, 'tests', 'fault_driver.py')
  result = subprocess.run([sys.executable, driver, killed, 'round', str(kill_round), '--stream'] +
                          ([f'--run={name}'] if name != 'fedre' else []), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
  original, resumed = Federation.round, []

  def interrupted_round(self, state):  # SIGINT inside the first resumed round: it ends, checkpoints and stops
    if not resumed:
      resumed.append(int(state.round))
      os.kill(os.getpid(), signal.SIGINT)
    return original(self, state)
  monkeypatch.setattr(Federation, 'round', interrupted_round)
  with pytest.raises(interrupts.Interrupted) as stopped:
    train_and_evaluate(cfg, killed, resume=True, progress=False)
  assert stopped.value.resumable and stopped.value.rounds_done == resumed[0] + 1 < cfg.rounds
  monkeypatch.setattr(Federation, 'round', original)
  train_and_evaluate(cfg, killed, resume=True, progress=False)
  assert metric_rows(killed) == metric_rows(whole)
  assert not os.path.exists(os.path.join(killed, 'checkpoints.unreadable'))


def test_stream_clients_may_be_added_on_resume_without_setting_checkpoints_aside(finished, tmp_path):
  """A checkpoint of device-resident states restores into a run that keeps them on the host."""
  import dataclasses
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  train_and_evaluate(dataclasses.replace(CFG, rounds=5, strategy='vmap', stream_clients=True), run, resume=True,
                     progress=False)
  assert [r['round'] for r in metric_rows(run)] == [1, 2, 3, 4, 5]
  assert metric_rows(run)[:4] == metric_rows(finished)
  assert not os.path.exists(os.path.join(run, 'checkpoints.unreadable'))


def _change_one_array(checkpoint: str) -> None:
  """Replaces a checkpoint's state with a sound orbax state whose largest array differs in one entry, its digests
  left as they were: changed bytes that orbax reads without complaint. (Bytes overwritten in a data file are not:
  where they land in a compressed block, orbax cannot read the file at all.)"""
  import shutil
  import orbax.checkpoint as ocp
  state = os.path.join(checkpoint, 'state')
  checkpointer = ocp.StandardCheckpointer()
  arrays = checkpointer.restore(state)
  largest = max(arrays, key=lambda k: np.size(arrays[k]))
  changed = np.array(arrays[largest])
  changed.flat[changed.size // 2] += 1.0
  checkpointer.save(checkpoint + '.changed', {**arrays, largest: changed})
  checkpointer.wait_until_finished()
  shutil.rmtree(state)
  shutil.move(checkpoint + '.changed', state)


def test_a_checkpoint_whose_bytes_were_damaged_is_set_aside_and_the_one_before_used(finished, tmp_path, caplog):
  """Bytes changed on disk that orbax reads without complaint: the digests written with the checkpoint differ, so
  it is moved aside and the run continues from the one before, equal to the uninterrupted run."""
  import shutil
  run = str(tmp_path / 'run')
  shutil.copytree(finished, run)
  _change_one_array(os.path.join(run, 'checkpoints', '4'))
  with open(os.path.join(run, 'metrics.jsonl')) as f:
    rows = f.readlines()
  with open(os.path.join(run, 'metrics.jsonl'), 'w') as f:
    f.writelines(rows[:2])
  train_and_evaluate(CFG, run, resume=True, progress=False)
  assert metric_rows(run) == metric_rows(finished)
  assert os.listdir(os.path.join(run, 'checkpoints.unreadable')) == ['4']
  assert 'checkpoint of round 4 is damaged' in caplog.text


def test_a_state_of_another_structure_is_refused_without_moving_the_checkpoint(finished, tmp_path):
  """A reader whose state has other arrays than the checkpoint (another version's state) is not damage."""
  import jax.numpy as jnp
  checkpoints = Checkpoints(os.path.join(finished, 'checkpoints'))
  template = {'a': jnp.zeros(3), 'b': jnp.zeros((2, 2), jnp.int32)}
  with pytest.raises(CheckpointError, match='holds a state of .* arrays, and this run.s state has 2 .* left as it '
                                            'is'):
    checkpoints.restore_latest(template)
  assert sorted(os.listdir(os.path.join(finished, 'checkpoints'))) == ['2', '4']


def test_run_settings_ignore_other_methods_and_fill_fields_added_since():
  """A finished run or checkpoint written before a method was registered (or before a field existed) still
  matches the same run now; a changed hyperparameter of the run's own method does not."""
  import json
  from fedjax_het.run.config import run_settings
  now = dataclasses.replace(CFG, algorithm='fedproto').to_dict()
  old = json.loads(json.dumps(now))
  del old['methods']['felo'], old['local_steps']
  old['methods']['fedre']['mechanism'] = 'rsr'                          # another method's hyperparameter
  assert run_settings(old) == run_settings(now)
  old['methods']['fedproto']['lamda'] = 1.0
  assert run_settings(old) != run_settings(now)
