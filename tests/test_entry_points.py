"""Every command speaks with one voice: a bad flag, a bad value and an unknown name each give one line,
`error: WHAT. Fix: HOW.`, on stderr and the exit status `errors.EXIT_USAGE` (2), before anything runs; the
experiments' scripts, python -m fedjax_het.flower.local, python -m fedjax_het.data.prepare and python -m
fedjax_het.run.launch. In process through each command's own main; two subprocesses check absl's app.run path."""

import functools
import logging
import os
import subprocess
import sys

import pytest
from absl import flags

from fedjax_het.errors import EXIT_USAGE, error_line, with_fix
from fedjax_het.run import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ['--dataset=digits', '--num_clients=2', '--models=mlp', '--rounds=1']


def one_error_line(stderr: str) -> str:
  """The single line of `stderr`, which must be `error: ... Fix: ...`."""
  lines = stderr.strip().splitlines()
  assert len(lines) == 1, stderr
  assert lines[0].startswith('error: ') and ' Fix: ' in lines[0], lines[0]
  return lines[0]


def error_after_the_runs_lines(stderr: str) -> str:
  """The last line of `stderr`, `error: ... Fix: ...`, after nothing but the run's own lines ('fedre: ...'): no log
  line of another library (absl's 'W1128 ...' of tfds)."""
  *before, last = stderr.strip().splitlines()
  assert all(line.startswith('fedre: ') for line in before), stderr
  return one_error_line(last)


def test_a_message_without_a_fix_gets_one_and_stays_on_one_line():
  assert error_line('--rounds=-1 must be >= 0.') == 'error: --rounds=-1 must be >= 0. Fix: --rounds=0 or more.'
  assert with_fix('--lr=0 must be > 0.5') == '--lr=0 must be > 0.5. Fix: a value of --lr above 0.5.'
  assert with_fix('two\n  lines. Fix: one.') == 'two lines. Fix: one.'
  assert 'Fix: change --x as this line says' in with_fix('--x=3: too big')


def experiment(tmp_path, *args):
  """An experiment script's command line (experiments/fedre.py and the rest: `cli.app_run(cli.main)`) in process:
  the exit status."""
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  flags.mark_flag_as_required('workdir', flag_values=fv)
  return cli.command(functools.partial(cli.main, fv=fv), ['fedre.py', *args], fv)


@pytest.mark.parametrize('args, says', [
    (['--roundz=3'], '--roundz is not a flag of this command (did you mean --rounds?)'),
    (['--rounds=-1'], '--rounds=-1 must be >= 0. Fix: --rounds=0 or more.'),
    (['--rounds=abc'], '--rounds=abc: not an integer. Fix: --rounds takes an integer.'),
    (['--partition=dirichlett'], 'Fix: --partition takes one of'),
    (['--flagfile=no/such.flags'], '--flagfile: Unable to open flagfile'),
    (['leftover'], "unexpected arguments ['leftover']"),
    (['--algorithm=fedrex'], "--algorithm='fedrex' is unknown"),
    (['--models=mlp,resnet99'], "--models: unknown model 'resnet99'; the closest are resnet8,"),
])
def test_an_experiment_script_says_one_line_and_exits_2(tmp_path, capsys, args, says):
  assert experiment(tmp_path, *SMALL, f'--workdir={tmp_path}', *args) == EXIT_USAGE
  line = one_error_line(capsys.readouterr().err)
  assert says in line and len(line) < 400, line


def test_a_missing_required_flag_and_an_unprepared_dataset_are_one_line(tmp_path, capsys, caplog):
  assert experiment(tmp_path, *SMALL) == EXIT_USAGE
  assert one_error_line(capsys.readouterr().err) == (
      'error: --workdir is required. Fix: --workdir=VALUE (Output folder: metrics.jsonl, summary.json, accuracy.png, '
      'checkpoints/).')
  with caplog.at_level(logging.INFO):
    assert experiment(tmp_path, *SMALL, f'--workdir={tmp_path}/run', '--dataset=cifar10',
                      f'--data_dir={tmp_path}/data') == EXIT_USAGE
  assert 'is not prepared under' in error_after_the_runs_lines(capsys.readouterr().err)
  assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []  # tfds's own warning


def test_flower_local_speaks_the_same(tmp_path, capsys):
  from fedjax_het.flower import local
  start = ['--flagfile=' + os.path.join(ROOT, 'experiments', 'flags', 'quickstart.flags'), f'--workdir={tmp_path}']
  for bad, says in [('--roundz=3', 'did you mean --rounds?'), ('--rounds=-1', 'Fix: --rounds=0 or more.'),
                    ('--engine=sim', 'Fix: --engine takes one of deployment, simulation.'),
                    ('--models=resnet99', "unknown model 'resnet99'")]:
    assert local.main(start + [bad]) == EXIT_USAGE, bad
    assert says in one_error_line(capsys.readouterr().err), bad


def test_prepare_speaks_the_same(capsys):
  from fedjax_het.data import prepare
  for argv, says in [(['--dta_dir=x', 'cifar10'], '--dta_dir is not an option of python -m fedjax_het.data.prepare '
                                                   '(did you mean --data_dir?)'),
                     (['cifar10', '--archive'], '--archive: expected one argument.'),
                     (['imagenet'], "unknown dataset 'imagenet' (did you mean tinyimagenet?)"),
                     ([], 'name one or more datasets')]:
    assert prepare.main(argv) == EXIT_USAGE, argv
    assert says in one_error_line(capsys.readouterr().err), argv


def test_the_launcher_speaks_the_same(capsys, monkeypatch):
  from fedjax_het.run import launch
  monkeypatch.chdir(ROOT)
  monkeypatch.setattr(launch, 'launch', lambda *a, **k: pytest.fail('nothing is started for a bad command line'))
  for argv, says in [(['--num_procs=2', 'experiments/fedre.py'], 'did you mean --num_processes?'),
                     (['--num_processes=abc', 'experiments/fedre.py'], "--num_processes: invalid int value: 'abc'"),
                     (['--num_processes=0', 'experiments/fedre.py'], 'Fix: --num_processes=1 or more.'),
                     (['experiments/fedrr.py'], 'experiments/fedrr.py: no such file (did you mean experiments/fedre.py')]:
    assert launch.main(argv) == EXIT_USAGE, argv
    assert says in one_error_line(capsys.readouterr().err), argv


def test_every_experiment_script_goes_through_the_front_door():
  """Each script hands its main to `cli.app_run` and prints no error line of its own."""
  scripts = sorted(f for f in os.listdir(os.path.join(ROOT, 'experiments')) if f.endswith('.py'))
  assert 'fedre.py' in scripts and 'compare.py' in scripts
  for script in scripts:
    with open(os.path.join(ROOT, 'experiments', script)) as f:
      text = f.read()
    assert 'cli.app_run(' in text and "sys.exit(f'error" not in text and "sys.exit('error" not in text, script


def test_absls_app_run_path_is_the_same_line():
  """The scripts as run from a shell: absl's flags parser (formerly its 'FATAL Flags parsing error', status 1) and
  a script's own main (compare.py's --seeds)."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  runs = [subprocess.Popen([sys.executable, os.path.join(ROOT, 'experiments', script), *args], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for script, args in [('fedre.py', ['--workdir=/nonexistent', '--roundz=3']),
                               ('compare.py', ['--workdir=/nonexistent', '--seeds=a'])]]
  (_, fedre_err), (_, compare_err) = [p.communicate(timeout=120) for p in runs]
  assert [p.returncode for p in runs] == [EXIT_USAGE, EXIT_USAGE], (fedre_err, compare_err)
  assert 'did you mean --rounds?' in one_error_line(fedre_err)
  assert 'Fix: e.g. --seeds=0,1,2' in one_error_line(compare_err)


def test_a_resume_says_from_which_round_and_what_changed(tmp_path, capsys):
  import dataclasses
  from runs import CFG
  from fedjax_het.run.experiment import train_and_evaluate
  train_and_evaluate(dataclasses.replace(CFG, rounds=2), str(tmp_path), progress=False)
  train_and_evaluate(dataclasses.replace(CFG, rounds=3, checkpoint_every=1), str(tmp_path), resume=True,
                     progress=True)
  assert (f'fedre: resumed {tmp_path} from its checkpoint of round 2; changed since config.json: --rounds=2 -> 3, '
          f'--checkpoint_every=2 -> 1\n') in capsys.readouterr().err


def test_a_comparison_says_which_runs_it_reused(tmp_path, capsys):
  import dataclasses
  from runs import CFG
  from fedjax_het.run.compare import run_comparison
  base = dataclasses.replace(CFG, rounds=1)
  run_comparison(base, ['fedre'], [0], str(tmp_path))
  assert f'compare: 1/1 fedre, seed 0: running in {tmp_path}/fedre/seed0\n' in capsys.readouterr().err
  run_comparison(base, ['fedre'], [0], str(tmp_path))
  assert f'compare: 1/1 fedre, seed 0: reused the finished run in {tmp_path}/fedre/seed0\n' in capsys.readouterr().err
