"""A Flower deployment on this machine: a SuperLink, one SuperNode per client (separate processes talking over
localhost), and the run, in one command.

  python -m fedjax_het.flower.local --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/fedre_flower

The run's outputs are the simulation's (metrics.jsonl, summary.json, plots, checkpoints/) in --workdir; the nodes
keep their clients' states in WORKDIR/flower_nodes; the SuperLink's and SuperNodes' logs go to WORKDIR/flower_logs.
--resume continues a stopped run from its last checkpoint; --engine=simulation runs Flower's Simulation Engine (Ray)
instead of SuperNode processes. Several machines: docs/distributed.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from fedjax_het.launch import free_port

CONNECTION = 'fedjax-het-local'
APP_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'experiments',
                       'flower')


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


def _stop(processes: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
  for p in processes:
    if p.poll() is None:
      os.killpg(p.pid, signal.SIGTERM)
  deadline = time.monotonic() + grace
  for p in processes:
    try:
      p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      os.killpg(p.pid, signal.SIGKILL)
      p.wait()


class LocalDeployment:
  """A SuperLink and `num_supernodes` SuperNodes on localhost (`start`, `stop`, a context manager), and
  `run(...)`, one fedjax_het run on them. `supernodes[k]` holds client k. With `simulation`, Flower's Simulation
  Engine instead: the SuperLink runs the ClientApps of `num_supernodes` simulated nodes itself, in Ray actors
  (needs `pip install 'fedjax_het[flower-simulation]'`)."""

  def __init__(self, num_supernodes: int, workdir: str, app_dir: str = APP_DIR, port: int = 0,
               simulation: bool = False):
    self.num_supernodes, self.workdir, self.app_dir = num_supernodes, os.path.abspath(workdir), app_dir
    self.simulation = simulation
    self.port = port or free_port()
    self.logs = os.path.join(self.workdir, 'flower_logs')
    self.home = os.path.join(self.logs, 'flwr_home')
    self.superlink: Optional[subprocess.Popen] = None
    self.supernodes: list[subprocess.Popen] = []

  def _spawn(self, command: list[str], log: str) -> subprocess.Popen:
    out = open(os.path.join(self.logs, log), 'a')
    env = dict(os.environ, FLWR_HOME=self.home)
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

  def start(self) -> 'LocalDeployment':
    os.makedirs(self.home, exist_ok=True)
    with open(os.path.join(self.home, 'config.toml'), 'w') as f:
      f.write(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
              f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')
    self.superlink = self._spawn(['flower-superlink', '--insecure', '--port', str(self.port), '--database',
                                  os.path.join(self.home, 'superlink.db'), '--disable-runtime-dependency-installation']
                                 + (['--simulation'] if self.simulation else []), 'superlink.log')
    wait_for_port(self.port, 60, self.superlink, 'flower-superlink')
    if not self.simulation:
      for k in range(self.num_supernodes):
        self.start_supernode(k)
    return self

  def start_supernode(self, k: int) -> subprocess.Popen:
    """(Re)starts the SuperNode of client k."""
    node_config = f'partition-id={k} state-dir="{os.path.join(self.workdir, "flower_nodes")}"'
    process = self._spawn(['flower-supernode', '--insecure', '--superlink', f'127.0.0.1:{self.port}', '--port',
                           str(free_port()), '--node-config', node_config], f'supernode_{k}.log')
    if k < len(self.supernodes):
      self.supernodes[k] = process
    else:
      self.supernodes.append(process)
    return process

  def kill_supernode(self, k: int) -> None:
    """Kills client k's SuperNode and the ClientApp it runs (SIGKILL), as a machine that goes down."""
    os.killpg(self.supernodes[k].pid, signal.SIGKILL)
    self.supernodes[k].wait()

  def run(self, flagfile: str, resume: bool = False, round_timeout: float = 600.0, connect_timeout: float = 120.0,
          run_name: str = 'default', stdout=None) -> int:
    """Runs the flags of `flagfile` on the nodes (flwr run, its log streamed to `stdout`); the exit status."""
    config = (f'flagfile="{os.path.abspath(flagfile)}" workdir="{self.workdir}" resume={str(resume).lower()} '
              f'round-timeout={float(round_timeout)} connect-timeout={float(connect_timeout)} '
              f'run-name="{run_name}"')
    if self.simulation:  # the simulated nodes' states, where the deployment's SuperNodes keep them
      config += f' state-dir="{os.path.join(self.workdir, "flower_nodes")}"'
    env = dict(os.environ, FLWR_HOME=self.home)
    federation = ['--federation-config', f'num-supernodes={self.num_supernodes}'] if self.simulation else []
    return subprocess.run(['flwr', 'run', self.app_dir, CONNECTION, '--run-config', config, '--stream'] + federation,
                          env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None).returncode

  def stop(self) -> None:
    _stop(self.supernodes + ([self.superlink] if self.superlink else []))

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(prog='python -m fedjax_het.flower.local', description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--flagfile', required=True, help='The run\'s flags, as experiments/ takes them.')
  parser.add_argument('--workdir', required=True, help='The run\'s outputs.')
  parser.add_argument('--resume', action='store_true', help='Continue from the last checkpoint in --workdir.')
  parser.add_argument('--round_timeout', type=float, default=600.0, help='Seconds a round waits for its replies; '
                      'then it goes on without the nodes that did not answer.')
  parser.add_argument('--port', type=int, default=0, help='The SuperLink\'s port (0: a free one).')
  parser.add_argument('--engine', choices=('deployment', 'simulation'), default='deployment', help='deployment: '
                      'a SuperNode process per client; simulation: Flower\'s Simulation Engine (Ray actors; '
                      'pip install \'fedjax_het[flower-simulation]\').')
  args = parser.parse_args(argv)
  if shutil.which('flower-superlink') is None:
    parser.error('flwr is not installed. Fix: pip install \'fedjax_het[flower]\'.')
  from fedjax_het.errors import ConfigError
  from fedjax_het.flower.server_app import config_from_flagfile
  try:
    cfg = config_from_flagfile(os.path.abspath(args.flagfile))
  except ConfigError as e:
    parser.error(str(e))
  simulation = args.engine == 'simulation'
  with LocalDeployment(cfg.num_clients, args.workdir, port=args.port, simulation=simulation) as deployment:
    nodes = 'simulated nodes (Ray)' if simulation else 'SuperNodes'
    print(f'SuperLink on 127.0.0.1:{deployment.port}, {cfg.num_clients} {nodes}, one per client; logs in '
          f'{deployment.logs}', flush=True)
    try:
      return deployment.run(args.flagfile, args.resume, args.round_timeout)
    except KeyboardInterrupt:
      sys.stderr.write(f'stopped: the last checkpoint in {deployment.workdir} stands; continue with --resume.\n')
      return 130


if __name__ == '__main__':
  sys.exit(main())
