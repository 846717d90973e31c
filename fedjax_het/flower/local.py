"""A Flower deployment on this machine: a SuperLink, one SuperNode per client (separate processes talking over
localhost), and the run, in one command.

  python -m fedjax_het.flower.local --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/fedre_flower
  python -m fedjax_het.flower.local --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/small \\
      --rounds=2 --num_clients=3

Every experiment flag of experiments/run.py is accepted; flags after --flagfile override the file's (--helpfull
lists them all). The run's outputs are the simulation's (metrics.jsonl, summary.json, plots, checkpoints/) in
--workdir; the nodes keep their clients' states in WORKDIR/flower_nodes; the SuperLink's and SuperNodes' logs go to
WORKDIR/flower_logs, and so does Flower's own log of the run (flwr_run.log): the terminal gets the run's lines
(what it waits for, each round, the summary, warnings and errors), in colour only where it is a terminal. Each
round prints its time as it ends: Flower starts a new process per message, so a round
takes seconds to tens of seconds where a simulation takes well under one (docs/distributed.md gives measured
times). --resume continues a stopped run from its last checkpoint; --engine=simulation runs Flower's Simulation
Engine (Ray) instead of SuperNode processes. Several machines: docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from absl import flags

from fedjax_het.errors import EXIT_FAILED, EXIT_USAGE, ConfigError, error_line
from fedjax_het.flower.run_config import (APP_DIR, NOT_KEYS, experiment_flag_values, key_of, run_config_argument)
from fedjax_het.run.launch import free_port

CONNECTION = 'fedjax-het-local'
PROG = 'python -m fedjax_het.flower.local'
RUN_LOG = 'flwr_run.log'  # in WORKDIR/flower_logs: everything `flwr run --stream` printed
ANSI = re.compile(r'\x1b\[[0-9;?]*[A-Za-z]')
# Flower's own lines in the stream, for its log only: its logger's DEBUG and INFO lines ('INFO :      Starting
# logstream ...'; its warnings and errors stay on the terminal), the same records again in Python's basic format
# ('DEBUG:flwr:...'), and flwr run's account of submitting the run.
FLOWER_LINE = re.compile(r'(?:DEBUG|INFO)\s*:\s|[A-Z]+:flwr:|Using SuperLink: |Successfully (?:started run|installed) ')


class RunOutput:
  """Where the output of `flwr run --stream` goes, line by line (a callable): every line to `log_path` as it came;
  the run's own lines (the ServerApp's: what it waits for, its rounds, its summary, its warnings and errors; and
  Flower's warnings and errors) to `terminal` (default stdout), their colour codes kept only where it is a
  terminal."""

  def __init__(self, log_path: str, terminal=None):
    self.log = open(log_path, 'a')
    self.terminal = terminal

  def __call__(self, line: str) -> None:
    self.log.write(line)
    self.log.flush()
    plain = ANSI.sub('', line)
    if FLOWER_LINE.match(plain):
      return
    terminal = sys.stdout if self.terminal is None else self.terminal
    isatty = getattr(terminal, 'isatty', None)
    terminal.write(line if isatty is not None and isatty() else plain)
    terminal.flush()

  def close(self) -> None:
    self.log.close()


def wait_for_port(port: int, seconds: float, process: subprocess.Popen, what: str) -> None:
  """Waits until something listens on 127.0.0.1:port; a RuntimeError if `process` exits or time runs out."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    if process.poll() is not None:
      raise RuntimeError(f'{what} exited with status {process.returncode} before it listened on port {port}.')
    with socket.socket() as s:
      if s.connect_ex(('127.0.0.1', port)) == 0:
        return
    time.sleep(0.1)
  raise RuntimeError(f'{what} did not listen on port {port} within {seconds:g} s.')


def descendants(pids: Sequence[int]) -> list[int]:
  """Every process started, directly or not, by one of `pids` (Linux's /proc; none elsewhere): the ServerApp and
  ClientApp processes a SuperLink or SuperNode starts may leave its process group."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir('/proc') if os.path.isdir('/proc') else []:
    if entry.isdigit():
      try:
        with open(f'/proc/{entry}/stat') as f:
          parent = int(f.read().rsplit(')', 1)[1].split()[1])
      except (OSError, IndexError, ValueError):
        continue
      children.setdefault(parent, []).append(int(entry))
  found, todo = [], list(pids)
  while todo:
    for child in children.get(todo.pop(), []):
      found.append(child)
      todo.append(child)
  return found


def _signal(pid: int, signum: int) -> None:
  try:
    os.kill(pid, signum)
  except OSError:
    pass


def _stop(processes: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
  """Stops `processes` and every process they started (SIGTERM, then SIGKILL after `grace` seconds)."""
  started = descendants([p.pid for p in processes])
  for p in processes:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  for pid in started:
    _signal(pid, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in processes:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()
  while time.monotonic() < deadline and any(os.path.exists(f'/proc/{pid}') for pid in started):
    time.sleep(0.1)
  for pid in started:
    _signal(pid, signal.SIGKILL)


def unfinished(summary: str, written_before: Optional[float]) -> Optional[str]:
  """Why the run whose summary.json is `summary` did not finish (that file unchanged since `written_before`, its
  mtime before the run, or not finished), or None when it finished."""
  if not os.path.exists(summary) or os.path.getmtime(summary) == written_before:
    return 'the ServerApp ended without writing summary.json (its output above says why)'
  try:
    with open(summary) as f:
      done = json.load(f)
  except (OSError, ValueError):
    return f'{summary} cannot be read'
  if done.get('diverged_round'):
    return f'training diverged in round {done["diverged_round"]} (summary.json)'
  if not done.get('finished'):
    return f'the run stopped after round {done.get("rounds", "?")} without finishing (summary.json)'
  return None


class LocalDeployment:
  """A SuperLink and `num_supernodes` SuperNodes on localhost (`start`, `stop`, a context manager), and
  `run(...)`, one fedjax_het run on them. `supernodes[k]` holds client k. With `simulation`, Flower's Simulation
  Engine instead: the SuperLink runs the ClientApps of `num_supernodes` simulated nodes itself, in Ray actors
  (needs `pip install 'fedjax_het[flower-simulation]'`). `compilation_cache`, when given, is the SuperNodes' XLA
  compilation cache ('': off; None: their default, ~/.cache/fedjax_het/xla)."""

  def __init__(self, num_supernodes: int, workdir: str, app_dir: str = APP_DIR, port: int = 0,
               simulation: bool = False, compilation_cache: Optional[str] = None, authenticate: bool = True):
    self.num_supernodes, self.workdir, self.app_dir = num_supernodes, os.path.abspath(workdir), app_dir
    self.simulation, self.compilation_cache = simulation, compilation_cache
    # SuperNodes authenticated (Flower's CLI-managed SuperNode authentication, over TLS); a simulation has none.
    self.authenticate = authenticate and not simulation
    self.port = port or free_port()
    self.logs = os.path.join(self.workdir, 'flower_logs')
    self.home = os.path.join(self.logs, 'flwr_home')
    self.credentials = os.path.join(self.logs, 'credentials')
    self.superlink: Optional[subprocess.Popen] = None
    self.failure: Optional[str] = None  # Flower's account of the last run's failure, if it failed
    self.supernodes: list[subprocess.Popen] = []
    self.others: list[subprocess.Popen] = []  # SuperNodes started with an identity of their own
    self.node_ids: dict[int, int] = {}  # client -> the node id its registered key gets (authenticated deployments)
    self.tls = None

  def _spawn(self, command: list[str], log: str, env: Optional[Mapping[str, str]] = None) -> subprocess.Popen:
    out = open(os.path.join(self.logs, log), 'a')
    env = dict(os.environ, FLWR_HOME=self.home, **(env or {}))
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

  def start(self) -> 'LocalDeployment':
    os.makedirs(self.home, exist_ok=True)
    connection = 'insecure = true\n'
    security = ['--insecure']
    if self.authenticate:
      from fedjax_het.flower.credentials import tls_files
      self.tls = tls_files(self.credentials)
      connection = f'root-certificates = {json.dumps(self.tls.ca_certificate)}\n'
      security = ['--ssl-ca-certfile', self.tls.ca_certificate, '--ssl-certfile', self.tls.certificate,
                  '--ssl-keyfile', self.tls.private_key, '--enable-supernode-auth']
    database = os.path.join(self.home, 'superlink.db')
    if os.path.exists(database):  # a fresh SuperLink: nodes of an earlier start would be waited for as unavailable
      os.remove(database)
    with open(os.path.join(self.home, 'config.toml'), 'w') as f:
      f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
              f'address = "127.0.0.1:{self.port}"\n{connection}')
    self.superlink = self._spawn(['flower-superlink', *security, '--port', str(self.port), '--database',
                                  os.path.join(self.home, 'superlink.db'), '--disable-runtime-dependency-installation']
                                 + (['--simulation'] if self.simulation else []), 'superlink.log')
    wait_for_port(self.port, 60, self.superlink, 'flower-superlink')
    if not self.simulation:
      for k in range(self.num_supernodes):
        self.start_supernode(k)
    return self

  def register(self, k: int) -> str:
    """Client k's SuperNode key (made once, kept for its restarts), registered with the SuperLink: the private
    key's path. Its node id goes to `node_ids`."""
    if k not in self.node_ids:
      self.node_ids[k] = self._register_key(f'supernode_{k}')[1]
    return os.path.join(self.credentials, f'supernode_{k}')

  def _register_key(self, name: str) -> tuple[str, int]:
    """(private key path, node id) of a new key pair `name`, registered with the SuperLink."""
    from fedjax_het.flower.credentials import node_key_pair
    private, public = node_key_pair(self.credentials, name)
    done = subprocess.run(['flwr', 'supernode', 'register', public, CONNECTION, '--format', 'json'],
                          env=dict(os.environ, FLWR_HOME=self.home), capture_output=True, text=True)
    try:
      return private, int(json.loads(done.stdout)['node-id'])
    except (ValueError, KeyError, TypeError):
      raise RuntimeError(f'flwr supernode register did not register the key {public} (status {done.returncode}): '
                         f'{(done.stdout + done.stderr).strip()[-500:]}') from None

  def start_supernode(self, k: int, env: Optional[Mapping[str, str]] = None, identity: Optional[str] = None
                      ) -> subprocess.Popen:
    """(Re)starts the SuperNode of client k (with its registered key, where the deployment authenticates), its
    processes with the variables `env` added. With `identity`, another SuperNode claiming client k, with a key of
    its own registered under that name (not kept in `supernodes` or `node_ids`: a node the run must refuse)."""
    node_config = {'partition-id': k, 'state-dir': os.path.join(self.workdir, 'flower_nodes')}
    if self.compilation_cache is not None:
      node_config['compilation-cache'] = self.compilation_cache
    security = ['--insecure']
    if self.authenticate:
      key = self.register(k) if identity is None else self._register_key(identity)[0]
      security = ['--root-certificates', self.tls.ca_certificate, '--auth-supernode-private-key', key]
    process = self._spawn(['flower-supernode', *security, '--superlink', f'127.0.0.1:{self.port}', '--port',
                           str(free_port()), '--node-config', run_config_argument(node_config)],
                           f'supernode_{identity or k}.log', env)
    if identity is not None:
      self.others.append(process)
      return process
    if k < len(self.supernodes):
      self.supernodes[k] = process
    else:
      self.supernodes.append(process)
    return process

  def kill_supernode(self, k: int) -> None:
    """Kills client k's SuperNode and the ClientApp it runs (SIGKILL), as a machine that goes down."""
    os.killpg(self.supernodes[k].pid, signal.SIGKILL)
    self.supernodes[k].wait()

  def run_config(self, flagfile: str, resume: bool = False, round_timeout: float = 600.0,
                 connect_timeout: float = 120.0, run_name: str = 'default',
                 overrides: Optional[Mapping[str, Any]] = None) -> dict:
    """The run config `run` hands to `flwr run --run-config`: the deployment's keys, then `overrides` (run-config
    keys of experiment flags, `fedjax_het.flower.run_config`)."""
    config = {'flagfile': os.path.abspath(flagfile) if flagfile else '', 'workdir': self.workdir, 'resume': resume,
              'round-timeout': float(round_timeout), 'connect-timeout': float(connect_timeout), 'run-name': run_name}
    if self.simulation:  # the simulated nodes' states, where the deployment's SuperNodes keep them
      config['state-dir'] = os.path.join(self.workdir, 'flower_nodes')
    if self.node_ids:  # the node each client's registered key is: the server takes no other node's claim
      config['node-ids'] = json.dumps({str(k): v for k, v in sorted(self.node_ids.items())})
    config.update(overrides or {})
    return config

  def runs(self) -> dict[str, dict]:
    """The SuperLink's runs by run id, as `flwr ls --format json` lists them (status, status-details, ...)."""
    result = subprocess.run(['flwr', 'ls', CONNECTION, '--format', 'json'], env=dict(os.environ, FLWR_HOME=self.home),
                            capture_output=True, text=True)
    try:
      return {str(r['run-id']): r for r in json.loads(result.stdout).get('runs', [])}
    except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
      return {}

  def run(self, flagfile: str, resume: bool = False, round_timeout: float = 600.0, connect_timeout: float = 120.0,
          run_name: str = 'default', stdout=None, overrides: Optional[Mapping[str, Any]] = None,
          echo: Optional[Callable[[str], None]] = None) -> int:
    """Runs the flags of `flagfile` ('': the flags' defaults) with `overrides` (run-config keys of experiment
    flags, such as {'rounds': 2}) on the nodes (flwr run, its log streamed to `stdout`, or line by line to `echo`,
    e.g. a `RunOutput`); the exit status: 1 when the ServerApp failed (`failure` then holds Flower's account of
    it), flwr run's otherwise."""
    config = run_config_argument(self.run_config(flagfile, resume, round_timeout, connect_timeout, run_name,
                                                 overrides))
    env = dict(os.environ, FLWR_HOME=self.home)
    federation = ['--federation-config', f'num-supernodes={self.num_supernodes}'] if self.simulation else []
    before = self.runs()
    summary = os.path.join(self.workdir, 'summary.json')
    written = os.path.getmtime(summary) if os.path.exists(summary) else None
    self.failure = None
    command = ['flwr', 'run', self.app_dir, CONNECTION, '--run-config', config, '--stream'] + federation
    if echo is None:
      status = subprocess.run(command, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None).returncode
    else:
      streaming = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors='replace', bufsize=1)
      try:
        for line in streaming.stdout:
          echo(line)
      finally:
        if streaming.poll() is None and sys.exc_info()[0] is not None:
          streaming.kill()
        status = streaming.wait()
        streaming.stdout.close()
    if self.superlink is not None and self.superlink.poll() is not None:
      self.failure = f'the SuperLink stopped (status {self.superlink.returncode}; its log: {self.logs}/superlink.log)'
      return 1
    if status == 0:  # flwr run --stream exits 0 even when the ServerApp raised: ask the SuperLink how it ended
      new = [r for run_id, r in self.runs().items() if run_id not in before]
      if new and new[-1].get('status') == 'finished:failed':
        self.failure = str(new[-1].get('status-details') or 'the ServerApp failed')
        return 1
      self.failure = unfinished(summary, written)
      if self.failure:
        return 1
    return status

  def stop(self) -> None:
    """Stops the SuperNodes and the SuperLink (SIGTERM, then SIGKILL after a grace period)."""
    _stop(self.supernodes + self.others + ([self.superlink] if self.superlink else []))

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()


def find_flower_commands() -> None:
  """Makes Flower's commands (flower-superlink, flower-supernode, flwr) reachable by the processes this command
  starts: on PATH, or beside this Python (a virtual environment run by its path, not activated), whose folder then
  goes first on PATH. A ConfigError where neither has them."""
  if shutil.which('flower-superlink') is not None:
    return
  here = os.path.dirname(sys.executable)
  if os.path.exists(os.path.join(here, 'flower-superlink')):
    os.environ['PATH'] = here + os.pathsep + os.environ.get('PATH', '')
    return
  try:
    import flwr  # noqa: F401
  except ImportError:
    raise ConfigError(f'flwr is not installed for {sys.executable}. Fix: {sys.executable} -m pip install '
                      f'\'fedjax_het[flower]\'.') from None
  raise ConfigError(f'flwr is installed, but its commands (flower-superlink, flwr) are neither on PATH nor in '
                    f'{here}. Fix: put the folder of its commands on PATH (activate its virtual environment).')


LOCAL_FLAGS_MODULE = 'fedjax_het.flower.local'
HELP_ARGS = ('-h', '--help', '-?', '--helpshort')
# Experiment flags that go to the run config's own keys rather than to the keys of experiment flags.
DEPLOYMENT_FLAGS = {'workdir': 'workdir', 'resume': 'resume', 'compilation_cache': 'compilation-cache'}


def define_local_flags(fv: flags.FlagValues) -> None:
  """Defines this command's own flags (the deployment's, not the experiment's) on `fv`."""
  define = dict(flag_values=fv, module_name=LOCAL_FLAGS_MODULE)
  flags.DEFINE_enum('engine', 'deployment', ['deployment', 'simulation'], 'deployment: a SuperNode process per '
                    'client; simulation: Flower\'s Simulation Engine (Ray actors; pip install '
                    '\'fedjax_het[flower-simulation]\').', **define)
  flags.DEFINE_float('round_timeout', 600.0, 'Seconds a round waits for its replies; then it goes on without the '
                     'nodes that did not answer.', **define)
  flags.DEFINE_float('connect_timeout', 120.0, 'Seconds the first round waits for the nodes to connect.', **define)
  flags.DEFINE_integer('port', 0, 'The SuperLink\'s port (0: a free one).', **define)


@dataclasses.dataclass
class LocalRun:
  """A parsed command line: `flags` (the experiment's and this command's), `config` (the run's
  `ExperimentConfig`), `flagfile` (absolute, '' for none) and `overrides` (the run-config keys of the experiment
  flags given on the command line, which the ServerApp applies after the flag file)."""
  flags: flags.FlagValues
  config: Any
  flagfile: str
  overrides: dict


def _parse(argv: Sequence[str]) -> flags.FlagValues:
  fv = experiment_flag_values()
  define_local_flags(fv)
  try:
    rest = fv([PROG] + list(argv))
  except flags.Error as e:
    from fedjax_het.run import cli
    raise cli.flag_error(e, fv) from None
  if len(rest) > 1:
    raise ConfigError(f'unexpected arguments {rest[1:]}. Fix: give every setting as --flag=value.')
  return fv


def _without_flagfiles(argv: Sequence[str]) -> list[str]:
  """`argv` without its --flagfile arguments (the flags given on the command line itself)."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.lstrip('-').split('=', 1)[0]
    if arg.startswith('-') and name == 'flagfile':
      skip = '=' not in arg
      continue
    out.append(arg)
  return out


def _run_config_value(flag) -> Any:
  """A parsed flag's value as a run-config value (bool, int, float or str; a list as a, b, c)."""
  value = flag.value
  if isinstance(value, (list, tuple)):
    value = ','.join(str(v) for v in value)
  if value is None or value == '':
    raise ConfigError(f'--{flag.name}={flag.value if flag.value is not None else ""}: an empty value cannot go '
                      f'through Flower\'s run config (its "" keeps the flag file\'s value). Fix: leave --{flag.name} '
                      f'out, or set it in the flag file.')
  return value


def parse_command_line(argv: Sequence[str]) -> LocalRun:
  """The run of a command line (`--flagfile=FILE --workdir=DIR --rounds=2 ...`, without the program name): every
  experiment flag and this command's own, later flags overriding earlier ones and the flag file's. A ConfigError
  for a bad flag or value, naming it."""
  fv = _parse(argv)
  flagfile = _flagfile(argv)
  if not fv.workdir:
    raise ConfigError('--workdir is required: the run\'s outputs, the nodes\' states and the Flower logs go '
                      'there. Fix: --workdir=DIR.')
  from fedjax_het.run import cli
  from fedjax_het.run.config import flags_named
  from fedjax_het.run.experiment import validate
  from fedjax_het.flower.node import deployed_config
  config = cli.config_from_flags(fv)
  with flags_named():
    validate(deployed_config(config))  # the settings that need no data, before anything starts
  given = _parse(_without_flagfiles(argv))  # the flags given on the command line itself
  own = {f.name for f in fv.get_flags_for_module(LOCAL_FLAGS_MODULE)}
  overrides = {}
  for name in given:
    if not given[name].present or name in own or name == 'flagfile':
      continue
    if name in DEPLOYMENT_FLAGS:  # workdir and resume: `run`'s own arguments; compilation_cache: below
      continue
    if name in NOT_KEYS:
      raise ConfigError(f'--{name}: {NOT_KEYS[name]}. Fix: leave --{name} out.')
    overrides[key_of(name)] = _run_config_value(fv[name])
  if fv['compilation_cache'].present:  # from the flag file or the command line; '' turns the cache off
    overrides['compilation-cache'] = fv.compilation_cache or ''
  return LocalRun(fv, config, flagfile, overrides)


def _flagfile(argv: Sequence[str]) -> str:
  """The absolute path of the command line's --flagfile ('' for none); a ConfigError for several."""
  paths = []
  for i, arg in enumerate(argv):
    name, _, value = arg.lstrip('-').partition('=')
    if arg.startswith('-') and name == 'flagfile':
      paths.append(value if '=' in arg else (argv[i + 1] if i + 1 < len(argv) else ''))
  if len(paths) > 1:
    raise ConfigError(f'--flagfile is given {len(paths)} times; the Flower run reads one. Fix: one --flagfile (it '
                      f'may include others with --flagfile lines), the other settings as flags after it.')
  return os.path.abspath(paths[0]) if paths and paths[0] else ''


def help_text(argv: Sequence[str] = (), full: bool = False) -> str:
  """What --help prints: the usage, this command's own flags, then the experiment flags by group as the other
  entry points list them (the hyperparameters of the method --algorithm in `argv` names); with `full`
  (--helpfull), every method's hyperparameters too. The flags a Flower run sets itself are left out."""
  from fedjax_het.run import cli
  fv = experiment_flag_values()
  define_local_flags(fv)
  for name in set(NOT_KEYS) - set(DEPLOYMENT_FLAGS):
    delattr(fv, name)
  own = [line for flag in fv.get_flags_for_module(LOCAL_FLAGS_MODULE) for line in cli._flag_lines(flag)]
  usage = '\n'.join([__doc__.strip(), '', 'This command (a Flower run sets --strategy, --num_devices, --chunk_size, '
                     '--memory_budget_gib, --stream_clients, '
                     '--progress and --distributed itself):'] + own)
  text = cli.help_text(fv, usage, argv)
  if full:
    shown = set(cli.help_text(fv, '', argv).split())
    for module, module_flags in fv.flags_by_module_dict().items():
      rest = [f for f in module_flags if module.startswith('fedjax_het.run.registry') and f'--{f.name}' not in shown
              and f'--[no]{f.name}' not in shown]
      if rest:
        text += f'\n\n{module}:\n' + '\n'.join(line for f in rest for line in cli._flag_lines(f))
  return text


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command: parses `argv` (default: sys.argv[1:]), starts the deployment, runs, stops it; the exit status.
  A bad flag or setting prints one line, `error: ...`, and returns 2 before anything starts; a run that fails
  later prints the same kind of line and returns 1."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(arg in HELP_ARGS + ('--helpfull',) for arg in argv):
    print(help_text(argv, full='--helpfull' in argv))
    return 0
  try:
    run = parse_command_line(argv)
    find_flower_commands()
  except ConfigError as e:
    sys.stderr.write(error_line(e) + '\n')
    return EXIT_USAGE
  fv, cfg = run.flags, run.config
  simulation = fv.engine == 'simulation'
  cache = run.overrides.get('compilation-cache')  # the SuperNodes' too
  nodes = 'simulated nodes (Ray)' if simulation else 'SuperNodes'
  print(f'starting a SuperLink and {cfg.num_clients} {nodes}, one per client', flush=True)
  with LocalDeployment(cfg.num_clients, fv.workdir, port=fv.port, simulation=simulation,
                       compilation_cache=cache) as deployment:
    rounds = f'{cfg.rounds} round' + ('s' if cfg.rounds != 1 else '')
    print(f'SuperLink on 127.0.0.1:{deployment.port}; submitting the run: {rounds}, each printed as it ends; logs '
          f'(Flower\'s own in {RUN_LOG}) in {deployment.logs}', flush=True)
    output = RunOutput(os.path.join(deployment.logs, RUN_LOG))
    try:
      status = deployment.run(run.flagfile, fv.resume, fv.round_timeout, fv.connect_timeout, overrides=run.overrides,
                              echo=output)
      if deployment.failure:
        reason = deployment.failure.replace('ServerApp failed with exception: ', '')
        resume = (f'the last checkpoint in {deployment.workdir} stands: continue with --resume'
                  if os.path.isdir(os.path.join(deployment.workdir, 'checkpoints')) else 'run the command again')
        fix = '' if 'Fix:' in reason else f' Fix: what the ServerApp\'s output above says; then {resume}.'
        sys.stderr.write(error_line(f'{reason.rstrip().rstrip(".")} (the run\'s log: the ServerApp\'s output above; '
                                    f'the nodes\': {deployment.logs}).{fix}') + '\n')
        return EXIT_FAILED
      return status
    except KeyboardInterrupt:
      sys.stderr.write(f'stopped: the last checkpoint in {deployment.workdir} stands; continue with --resume.\n')
      return 130
    finally:
      output.close()


if __name__ == '__main__':
  sys.exit(main())
