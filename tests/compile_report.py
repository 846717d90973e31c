"""Where the suite's time goes: JAX's compile events summed per test file, over every pytest-xdist worker.

  PYTHONPATH=tests python -m pytest -q -n 2 --dist loadfile -p compile_report tests

prints, for the 25 files that spent most, the seconds of tracing, lowering to MLIR and XLA backend compilation (a
persistent-cache hit counts its retrieval there too), the programs compiled and how many of them the persistent
cache served. It only reads `jax.monitoring` events: the tests run as they would without it."""

import collections
import json
import os
import shutil
import tempfile

import jax

EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace', '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower',
          '/jax/core/compile/backend_compile_duration': 'backend', '/jax/compilation_cache/cache_retrieval_time_sec':
          'hit'}
_totals: dict = collections.defaultdict(collections.Counter)


def _listener(event: str, duration: float, **kwargs) -> None:
  if event in EVENTS:
    where = os.environ.get('PYTEST_CURRENT_TEST', '(outside a test)').split('::')[0]
    _totals[where][EVENTS[event]] += duration
    _totals[where][EVENTS[event] + '_n'] += 1


jax.monitoring.register_event_duration_secs_listener(_listener)


def pytest_configure(config):
  if not hasattr(config, 'workerinput'):  # the controller (or a run without workers): a folder for every process
    os.environ['FEDJAX_HET_COMPILE_REPORT'] = tempfile.mkdtemp(prefix='fedjax_het_compile_report_')


def pytest_sessionfinish(session):
  folder = os.environ.get('FEDJAX_HET_COMPILE_REPORT')
  if folder:
    name = getattr(session.config, 'workerinput', {}).get('workerid', 'main')
    with open(os.path.join(folder, name + '.json'), 'w') as f:
      json.dump(_totals, f)


def pytest_terminal_summary(terminalreporter, config):
  folder = os.environ.get('FEDJAX_HET_COMPILE_REPORT')
  if hasattr(config, 'workerinput') or not folder:
    return
  merged = collections.defaultdict(collections.Counter)
  for name in os.listdir(folder):
    with open(os.path.join(folder, name)) as f:
      for where, counts in json.load(f).items():
        merged[where].update(counts)
  shutil.rmtree(folder, ignore_errors=True)
  rows = sorted(merged.items(), key=lambda kv: -(kv[1]['trace'] + kv[1]['lower'] + kv[1]['backend']))
  line = lambda c, where: (f"{c['trace']:8.1f} {c['lower']:8.1f} {c['backend']:8.1f} {c['backend_n']:8d} "
                           f"{c['hit_n']:8d}  {where}")
  write = terminalreporter.write_line
  write('compile seconds per test file: trace, lower, backend; programs compiled, of them persistent-cache hits')
  for where, counts in rows[:25]:
    write(line(counts, where))
  write(line(sum((counts for _, counts in rows), collections.Counter()), '(every file)'))
