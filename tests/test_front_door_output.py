"""What the commands print and where: the run's own lines on the terminal, other tools' lines (Flower's log,
its colour codes) in log files; progress where a run waits."""

import os
import stat
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What `flwr run --stream` printed for `python -m fedjax_het.flower.local ... --rounds=1 --num_clients=3` (Flower
# 1.42), shortened: flwr's own account, Flower's coloured log lines, the ServerApp's lines, and Flower's records
# again in Python's basic format.
FLWR_RUN = '''Using SuperLink: fedjax-het-local (127.0.0.1:49243)
Successfully started run 14596341206818021560
\x1b[92mINFO \x1b[0m:      Starting logstream for run_id `14596341206818021560`
\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process
Successfully installed fedjax-het-flower to /tmp/fl1/flower_logs/flwr_home/apps/fedjax_het.fedjax-het-flower.1.0.0.7.
fedre: loading digits and splitting it over 3 clients (dirichlet)
round 1/1: 3 clients trained in 34.0 s, train_loss 1.7284
\x1b[93mWARNING \x1b[0m:   a warning of Flower's own
round 1/1: 3 clients evaluated in 18.5 s, accuracy 0.4457
{
  "final_accuracy": 0.44567627494456763
}
DEBUG:flwr:ServerApp finished running.
\x1b[92mINFO \x1b[0m:      
INFO:flwr:
DEBUG:flwr:[flwr-serverapp] Will push ServerApp task output
'''


def _fake_flower(bin_dir, workdir) -> None:
  """Flower's commands as scripts: `flwr run` prints FLWR_RUN and writes a finished summary.json, `flwr ls` lists no
  run."""
  bin_dir.mkdir()
  (bin_dir / 'transcript').write_text(FLWR_RUN)
  flwr = bin_dir / 'flwr'
  flwr.write_text(f'#!/bin/sh\nif [ "$1" = run ]; then cat {bin_dir / "transcript"}; '
                  f'echo \'{{"finished": true}}\' > {workdir / "summary.json"}; else echo \'{{"runs": []}}\'; fi\n')
  (bin_dir / 'flower-superlink').write_text('#!/bin/sh\n')
  for path in (flwr, bin_dir / 'flower-superlink'):
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_flower_local_redirected_prints_the_runs_lines_without_colour_codes_and_flowers_log_goes_to_a_file(
    tmp_path, monkeypatch, capfd):
  """`python -m fedjax_het.flower.local > FILE` once held Flower's colour codes and 'DEBUG:flwr:' lines; now its
  output is the run's own lines (and Flower's warnings), plain, and Flower's log goes to
  WORKDIR/flower_logs/flwr_run.log, whole."""
  from fedjax_het.flower import local
  workdir = tmp_path / 'run'
  workdir.mkdir()
  _fake_flower(tmp_path / 'bin', workdir)
  monkeypatch.setenv('PATH', str(tmp_path / 'bin') + os.pathsep + os.environ['PATH'])
  monkeypatch.setattr(local.LocalDeployment, 'start', lambda self: os.makedirs(self.logs, exist_ok=True) or self)
  monkeypatch.setattr(local.LocalDeployment, 'stop', lambda self: None)
  status = local.main([f'--flagfile={ROOT}/experiments/flags/quickstart.flags', f'--workdir={workdir}', '--rounds=1',
                       '--num_clients=3'])
  out, err = capfd.readouterr()
  assert status == 0, out + err
  assert '\x1b[' not in out + err and 'flwr:' not in out + err, out + err
  assert 'Starting logstream' not in out and 'Successfully' not in out, out
  lines = out.splitlines()
  assert lines[0] == 'starting a SuperLink and 3 SuperNodes, one per client'
  assert lines[2:] == ['fedre: loading digits and splitting it over 3 clients (dirichlet)',
                       'round 1/1: 3 clients trained in 34.0 s, train_loss 1.7284',
                       'WARNING :   a warning of Flower\'s own',
                       'round 1/1: 3 clients evaluated in 18.5 s, accuracy 0.4457',
                       '{', '  "final_accuracy": 0.44567627494456763', '}'], out
  assert (workdir / 'flower_logs' / 'flwr_run.log').read_text() == FLWR_RUN


def test_flowers_run_output_keeps_its_colours_on_a_terminal(tmp_path):
  from fedjax_het.flower.local import RunOutput

  class Terminal(list):
    def write(self, text):
      self.append(text)

    def flush(self):
      pass

    def isatty(self):
      return True
  terminal = Terminal()
  output = RunOutput(str(tmp_path / 'log'), terminal)
  for line in FLWR_RUN.splitlines(keepends=True):
    output(line)
  output.close()
  assert '\x1b[93mWARNING \x1b[0m:   a warning of Flower\'s own\n' in terminal
  assert not [line for line in terminal if 'flwr:' in line or 'INFO' in line]


def test_the_python_api_shows_a_bar_while_a_call_compiles(capfd):
  """The README's Python example sat silent for about a minute while its first calls compiled; a `Federation` now
  shows a bar on stderr over its groups and the server step while a call compiles (progress_bar=True; by default
  where stderr is a terminal or in a notebook), and none once its programs exist."""
  from fedjax_het.data import load_digits, make_federated_data
  from fedjax_het.engine import Federation, LocalTraining
  from fedjax_het.engine.federation import wants_progress_bar
  from fedjax_het.methods import FedREConfig, fedre
  data = make_federated_data(load_digits(), num_clients=4, partition='dirichlet', alpha=0.1, seed=0)
  fed = Federation(fedre(FedREConfig(), data.num_classes), data, models=['small_cnn_narrow', 'mlp'],
                   training=LocalTraining(learning_rate=0.05, batch_size=8, epochs=1), progress_bar=True)
  state = fed.init()
  state, _ = fed.round(state)
  err = capfd.readouterr().err
  assert 'fedre: compiling the initial states' in err and '/2 [' in err, err
  assert 'fedre: compiling round 1 (fedre)' in err and '/3 [' in err and 'the server step' in err, err
  state, _ = fed.round(state)
  assert 'compiling' not in capfd.readouterr().err
  assert not wants_progress_bar()  # pytest's captured stderr is no terminal, and no notebook runs here


@pytest.mark.slow  # an entry point's process (6 s); the Python API's bar above is the default run's
def test_a_command_line_start_says_each_compilation_with_a_bar_on_a_terminal_and_a_line_in_a_file(tmp_path, capfd,
                                                                                                 monkeypatch):
  """A run's start says what compiles: the initial states, round 1's groups and then the server step, and the
  first evaluation's groups; later rounds and evaluations compile nothing and show no such bar. Where stderr is a
  file, each is one line and each round one line (a bar's redraws would fill the file)."""
  from fedjax_het.run import experiment
  from fedjax_het.run.config import ExperimentConfig
  cfg = ExperimentConfig(dataset='digits', models=('mlp', 'small_cnn_narrow'), num_clients=4, rounds=2,
                         strategy='sequential', conv='xla')
  experiment.train_and_evaluate(cfg, str(tmp_path / 'file'), progress=True)  # pytest's stderr: no terminal
  err = capfd.readouterr().err
  assert '\r' not in err, err
  lines = [line for line in err.splitlines() if 'compiling' in line or ': round ' in line]
  assert lines == ['fedre: compiling round 1 (fedre) (2 architecture group(s), then the server step)',
                   'fedre: compiling the evaluation (2 architecture group(s))'] + lines[2:], err
  assert [line.split(':')[1].split('(')[0].strip() for line in lines[2:]] == ['round 1/2', 'round 2/2'], err
  assert ': loss=' in lines[2] and 'acc=' in lines[3]
  monkeypatch.setattr(experiment, 'wants_progress_bar', lambda: True)  # a terminal
  experiment.train_and_evaluate(cfg, str(tmp_path / 'terminal'), progress=True)
  err = capfd.readouterr().err
  assert 'fedre: initialising:' in err and 'fedre: compiling round 1 (fedre):' in err, err
  assert 'the server step' in err and 'fedre: compiling the evaluation:' in err, err
  assert '/2 [' in err and 'compiling round 2' not in err
  assert err.count('fedre: compiling the evaluation:   0%') == 1  # the second evaluation compiles nothing
  assert 'fedre: round 1/2' not in err  # the bar instead of the lines
