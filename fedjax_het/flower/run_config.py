"""The Flower run config of a fedjax_het run, and its keys' mapping onto the experiment flags.

The Flower App (experiments/flower/pyproject.toml) has two kinds of run-config keys. The deployment's own
(`DEPLOYMENT_KEYS`: flagfile, workdir, resume, timeouts, ...), and one key per experiment flag of
`fedjax_het.run.cli`: the flag's name with - for _ (`rounds`, `num-clients`, `local-learning-rate`). An experiment
key left at "" keeps the flag file's value (or the flag's default); any other value overrides it, as a flag given
after --flagfile does on the command line:

  flwr run experiments/flower mine --run-config 'flagfile="/abs/quickstart.flags" workdir="/abs/out" rounds=2'

Flower refuses a `--run-config` key that the app's pyproject.toml does not list, so that file lists every
experiment flag; `python -m fedjax_het.flower.run_config` rewrites its block of them from `fedjax_het.run.cli`.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Iterable, Mapping, Optional

from absl import flags

# The deployment's own run-config keys (not experiment flags; experiments/flower/pyproject.toml says what each sets).
DEPLOYMENT_KEYS = ('flagfile', 'workdir', 'resume', 'round-timeout', 'connect-timeout', 'run-name', 'state-dir',
                   'compilation-cache', 'upload-bound', 'node-ids')
# Experiment flags that a Flower run sets itself: flag -> why it has no run-config key of its own.
NOT_KEYS = {
    'workdir': 'the run config\'s workdir',
    'resume': 'the run config\'s resume',
    'compilation_cache': 'the run config\'s compilation-cache',
    'progress': 'a Flower run streams its log instead of a progress bar',
    'distributed': 'a Flower run\'s processes are its SuperLink and SuperNodes, not JAX processes',
    'strategy': 'each node trains its one client with the sequential executor',
    'num_devices': 'each node trains its one client on one device',
    'chunk_size': 'each node trains its one client alone (no vmapped chunks)',
    'memory_budget_gib': 'each node trains its one client alone (no vmapped chunks)',
    'stream_clients': 'each node keeps its own client\'s state',
}
RUN_NAME = re.compile(r'[A-Za-z0-9][A-Za-z0-9_.-]{0,127}')


def run_name(name) -> str:
  """The run config's run-name, which names a folder of this node's state-dir: letters, digits, '_', '.' and '-',
  starting with a letter or digit, so that no name the server sends reaches outside that folder."""
  from fedjax_het.errors import ConfigError
  if not isinstance(name, str) or not RUN_NAME.fullmatch(name):
    raise ConfigError(f'run config run-name={name!r}: a run name is 1-128 letters, digits, \'_\', \'.\' or \'-\', '
                      f'starting with a letter or digit (it names a folder of the node\'s state-dir). Fix: '
                      f'run-name="my-run-1".')
  return name


BEGIN = '# BEGIN experiment flags'
END = '# END experiment flags'
APP_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'experiments',
                       'flower')


def experiment_flag_values() -> flags.FlagValues:
  """A fresh FlagValues holding every experiment flag of `fedjax_het.run.cli` (the experiment entry points' flags)."""
  from fedjax_het.run import cli
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  return fv


def key_of(flag: str) -> str:
  """The run-config key of an experiment flag: its name with - for _ (Flower's convention)."""
  return flag.replace('_', '-')


def experiment_keys(fv: Optional[flags.FlagValues] = None) -> dict[str, str]:
  """run-config key -> experiment flag, for every experiment flag with a key of its own (all but `NOT_KEYS`)."""
  fv = fv if fv is not None else experiment_flag_values()
  keys = {key_of(name): name for name in fv if name not in NOT_KEYS}
  clash = sorted(set(keys) & set(DEPLOYMENT_KEYS))
  if clash:
    raise ValueError(f'experiment flags {clash} clash with the deployment\'s run-config keys')
  return keys


def flag_argument(flag: str, value: Any) -> str:
  """The command-line argument `--flag=value` of a run-config value (a bool as true/false)."""
  if isinstance(value, bool):
    value = 'true' if value else 'false'
  return f'--{flag}={value}'


def override_arguments(run_config: Mapping[str, Any], fv: Optional[flags.FlagValues] = None) -> list[str]:
  """The flag arguments (`--rounds=2`, ...) of the run config's experiment keys that are not "", in key order; a
  ConfigError for a key that is neither the deployment's nor an experiment flag's."""
  from fedjax_het.errors import ConfigError
  keys = experiment_keys(fv)
  arguments = []
  for key, value in run_config.items():
    if key in DEPLOYMENT_KEYS or value == '':
      continue
    if key not in keys:
      flag = key.replace('-', '_')
      why = f' ({NOT_KEYS[flag]} sets it)' if flag in NOT_KEYS else ''
      raise ConfigError(f'run config key {key!r} is no experiment flag{why}. Fix: a key of '
                        f'experiments/flower/pyproject.toml, an experiment flag\'s name with - for _.')
    arguments.append(flag_argument(keys[key], value))
  return arguments


def toml_value(value: Any) -> str:
  """`value` (bool, int, float, str) as TOML writes it, as Flower's --run-config parses it."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, float)):
    return repr(value)
  value = str(value)
  if '"' not in value and '\\' not in value:
    return f'"{value}"'
  if "'" not in value:
    return f"'{value}'"  # a TOML literal string: no escapes
  from fedjax_het.errors import ConfigError
  raise ConfigError(f'{value!r} holds both \' and ", which no value of Flower\'s --run-config can carry (it reads a '
                    f'value up to the quote that opened it). Fix: a path or value without one of them.')


def run_config_argument(config: Mapping[str, Any]) -> str:
  """The `flwr run --run-config` argument of `config`: space-separated key=value pairs."""
  return ' '.join(f'{key}={toml_value(value)}' for key, value in config.items())


def pyproject_block(fv: Optional[flags.FlagValues] = None) -> str:
  """The lines of experiments/flower/pyproject.toml that list the experiment flags' run-config keys."""
  lines = [BEGIN + ' (python -m fedjax_het.flower.run_config writes this block from fedjax_het.run.cli). A key is',
           '# the flag\'s name with - for _; "" keeps the flag file\'s value (or the flag\'s default).']
  lines += [f'{key} = ""' for key in experiment_keys(fv)]
  return '\n'.join(lines + [END])


def with_block(text: str, block: str) -> str:
  """`text` (a pyproject.toml) with its block of experiment flags replaced by `block` (appended if it has none)."""
  pattern = re.compile(re.escape(BEGIN) + r'.*?' + re.escape(END), re.S)
  if pattern.search(text):
    return pattern.sub(lambda _: block, text)
  return text.rstrip('\n') + '\n\n' + block + '\n'


def main(argv: Iterable[str] = ()) -> int:
  """Rewrites the experiment flags' block of the app's pyproject.toml (or of the file given)."""
  argv = list(argv)
  if any(a in ('-h', '--help', '-help') for a in argv) or len(argv) > 1:
    print('usage: python -m fedjax_het.flower.run_config [PYPROJECT_TOML]\n\nRewrites the block of experiment flags '
          'of the Flower app\'s pyproject.toml (default: experiments/flower/pyproject.toml) from fedjax_het.run.cli\'s '
          'flags.', file=sys.stdout if len(argv) == 1 else sys.stderr)
    return 0 if len(argv) == 1 else 2
  path = argv[0] if argv else os.path.join(APP_DIR, 'pyproject.toml')
  try:
    with open(path) as f:
      text = f.read()
  except OSError as e:
    print(f'error: cannot read {path} ({e.strerror}). Fix: give the path of a Flower app\'s pyproject.toml.',
          file=sys.stderr)
    return 2
  new = with_block(text, pyproject_block())
  if new != text:
    with open(path, 'w') as f:
      f.write(new)
  print(f'{path}: {"rewritten" if new != text else "up to date"}')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
