"""Starts one run as N JAX processes on this machine: what a SLURM or TPU-pod job does across hosts, locally.

  python -m fedjax_het.run.launch --num_processes=2 --cpu_devices=2 experiments/fedre.py \\
      --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/fedre_2proc

Each process runs the entry point with the same flags plus --distributed, and the variables
`fedjax_het.run.distributed.initialize` reads (the coordinator on a free localhost port, the process count and its
index); with --cpu_devices each process gets that many CPU devices. Process 0's output is this command's, less
the lines the libraries under it print on their own (gloo's '[Gloo] Rank 0 is connected to 1 peer ranks', written
to stdout from C++ by JAX's CPU collectives), which go to process_0.log with the rest of its stdout; the others' output goes
to a log each (--log_dir; default WORKDIR/process_logs for a command with --workdir, else a temporary folder
removed when the run succeeds), shown when one of them fails. The processes end with the launcher, however
it ends (even kill -9: the kernel sends them SIGTERM, and they checkpoint and stop).

Ctrl-C or SIGTERM is passed to every process once (each finishes the round, they checkpoint together and stop); a
second one is passed on too (abort). When a process fails, the others, which would wait for it in their next
collective, are killed, and the launcher exits with the failed process's status.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from fedjax_het.run.distributed import COORDINATOR, NUM_PROCESSES, PROCESS_ID

LOG_TAIL_LINES = 30
# Lines that libraries print on their own into a process's stdout: gloo's connection report (C++ std::cout, from
# JAX's CPU collectives, once per communicator it opens), which the launcher keeps to process 0's log.
LIBRARY_LINES = ('[Gloo] ',)


def relay_output(source, terminal, log) -> None:
  """Copies process 0's stdout (`source`, a binary pipe) as it comes: every line to `log`, and every line but
  the libraries' own (`LIBRARY_LINES`) to `terminal` (a text stream); until `source` ends."""
  for line in iter(source.readline, b''):
    log.write(line)
    log.flush()
    text = line.decode(errors='replace')
    if not text.startswith(LIBRARY_LINES):
      terminal.write(text)
      terminal.flush()


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class LaunchError(ValueError):
  """A launch that cannot start; the message says why and how to fix it."""


def port_is_free(port: int) -> bool:
  """Whether 127.0.0.1:port can be bound now."""
  with socket.socket() as s:
    try:
      s.bind(('127.0.0.1', port))
      return True
    except OSError:
      return False


def workdir_of(command: Sequence[str]) -> Optional[str]:
  """The --workdir a command line gives (`--workdir=X` or `--workdir X`), or None."""
  for i, arg in enumerate(command):
    if arg.startswith('--workdir='):
      return arg.split('=', 1)[1] or None
    if arg == '--workdir' and i + 1 < len(command):
      return command[i + 1]
  return None


def _end_with_parent() -> None:
  """In a child before it runs: SIGTERM when the launcher ends, however it ends (Linux's PR_SET_PDEATHSIG)."""
  if sys.platform.startswith('linux'):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def process_environment(index: int, num_processes: int, coordinator: str, cpu_devices: int,
                        base: Optional[dict] = None) -> dict:
  """The environment of process `index`: `base` (default os.environ) plus the distributed variables and, with
  `cpu_devices`, JAX on that many CPU devices."""
  env = dict(os.environ if base is None else base)
  env.update({COORDINATOR: coordinator, NUM_PROCESSES: str(num_processes), PROCESS_ID: str(index)})
  if cpu_devices:
    env.update(JAX_PLATFORMS='cpu', JAX_NUM_CPU_DEVICES=str(cpu_devices))
  return env


def _tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
  try:
    with open(path, errors='replace') as f:
      return ''.join(f.readlines()[-lines:])
  except OSError:
    return ''


def launch(command: Sequence[str], num_processes: int, cpu_devices: int = 0, log_dir: Optional[str] = None,
           port: int = 0, poll_seconds: float = 0.1) -> int:
  """Runs `command` (an entry point and its flags; a .py file is run with this Python) as `num_processes`
  processes joined by --distributed; returns the exit status (0, or the first failed process's)."""
  command = list(command)
  if command and command[0].endswith('.py'):
    command = [sys.executable] + command
  command.append('--distributed')
  if port and not port_is_free(port):
    raise LaunchError(f'--port={port}: something on this machine listens on 127.0.0.1:{port} already. Fix: another '
                      f'--port, or leave it out (a free one is chosen).')
  coordinator = f'127.0.0.1:{port or free_port()}'
  temporary = log_dir is None and workdir_of(command) is None
  log_dir = log_dir or (os.path.join(workdir_of(command), 'process_logs') if not temporary
                        else tempfile.mkdtemp(prefix='fedjax_het_launch_'))
  os.makedirs(log_dir, exist_ok=True)
  procs, logs = [], []
  for i in range(num_processes):
    env = process_environment(i, num_processes, coordinator, cpu_devices)
    log = open(os.path.join(log_dir, f'process_{i}.log'), 'wb' if i == 0 else 'w')
    logs.append(log)
    if i == 0:  # its stdout through the launcher (libraries' own lines to its log), its stderr the terminal's
      env['PYTHONUNBUFFERED'] = '1'  # each line as it is printed
    # Own sessions: a Ctrl-C in the terminal reaches the launcher alone, which passes it on once to each.
    procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE if i == 0 else log,
                                  stderr=None if i == 0 else subprocess.STDOUT,
                                  start_new_session=True, preexec_fn=_end_with_parent))
  import threading
  relay = threading.Thread(target=relay_output, args=(procs[0].stdout, sys.stdout, logs[0]), daemon=True)
  relay.start()

  def forward(signum, frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        break
      if all(c == 0 for c in codes):
        relay.join(timeout=10)
        if temporary:
          shutil.rmtree(log_dir, ignore_errors=True)
        return 0
      time.sleep(poll_seconds)
    first = failed[0]
    # After a stop signal every process exits with the same status (130 / 143) at about the same time.
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline and codes[first] in (130, 143):
      time.sleep(poll_seconds)
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    code = procs[first].returncode
    from fedjax_het.errors import EXIT_USAGE
    if code not in (130, 143) and not (first == 0 and code == EXIT_USAGE):  # process 0's error line says it
      where = 'its output is above' if first == 0 else f'the end of its log ({logs[first].name}):'
      sys.stderr.write(f'\nfedjax_het.launch: process {first} of {num_processes} exited with status {code}; '
                       f'stopped the others. {where}\n')
      if first:
        sys.stderr.write(_tail(logs[first].name))
    return code if code > 0 else 128 - code  # a process killed by signal s: 128 + s, as a shell reports it
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    relay.join(timeout=10)  # process 0's last lines (it has ended, or was killed: its pipe is closed)
    for log in logs:
      log.close()


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The command line; the exit status: 0, the first failed process's, or `EXIT_USAGE` (2) with one line on stderr
  for a bad option, value or entry point, before any process starts."""
  from fedjax_het.errors import EXIT_USAGE, ConfigError, error_line
  try:
    return _main(argv)
  except (ConfigError, LaunchError) as e:
    sys.stderr.write(error_line(e) + '\n')
    return EXIT_USAGE


def _main(argv: Optional[Sequence[str]]) -> int:
  from fedjax_het.errors import argument_parser, did_you_mean
  parser = argument_parser(prog='python -m fedjax_het.run.launch', description=__doc__.split('\n\n')[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--num_processes', type=int, default=2, help='Processes to start (default 2).')
  parser.add_argument('--cpu_devices', type=int, default=0, help='Run JAX on this many CPU devices per process '
                      '(0: the platform\'s own devices, e.g. the GPUs each process sees).')
  parser.add_argument('--log_dir', default=None, help='Folder for the logs of processes 1.. (default: '
                      'WORKDIR/process_logs for a command with --workdir, else a temporary folder removed when the run '
                      'succeeds).')
  parser.add_argument('--port', type=int, default=0, help='The coordinator\'s localhost port (0: a free one).')
  parser.add_argument('command', nargs=argparse.REMAINDER, help='The entry point and its flags, e.g. '
                      'experiments/fedre.py --flagfile=...')
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    raise LaunchError(f'--num_processes={args.num_processes} must be >= 1. Fix: --num_processes=1 or more.')
  if args.cpu_devices < 0:
    raise LaunchError(f'--cpu_devices={args.cpu_devices} must be >= 0. Fix: --cpu_devices=0 (the platform\'s own '
                      f'devices) or more.')
  if not args.command:
    raise LaunchError('no entry point to run. Fix: name it after the options, e.g. experiments/fedre.py '
                      '--flagfile=... --workdir=...')
  entry = args.command[0]
  if entry.endswith('.py') and not os.path.isfile(entry):
    scripts = [os.path.join('experiments', f) for f in sorted(os.listdir('experiments'))
               if f.endswith('.py')] if os.path.isdir('experiments') else []
    raise LaunchError(f'{entry}: no such file{did_you_mean(entry, scripts)}. Fix: the path of an entry point '
                      f'(experiments/fedre.py, experiments/run.py, ...), from the folder it is relative to.')
  return launch(args.command, args.num_processes, args.cpu_devices, args.log_dir, args.port)


if __name__ == '__main__':
  sys.exit(main())
