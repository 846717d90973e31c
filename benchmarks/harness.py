"""Shared pieces of the benchmark scripts: data, a jitted SGD step, compile logging, timing, result files."""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shlex
import sys
import time
from typing import Any, Callable

import jax
import numpy as np

from fedjax_het.core import Batch, ClientState
from fedjax_het.data import FederatedData, make_federated_data
from fedjax_het.data.datasets import Dataset, normalize_uint8
from fedjax_het.engine import LocalTraining
from fedjax_het.methods.shared.base import sgd_program
from fedjax_het.methods.shared.common import cross_entropy_loss
from fedjax_het.run.workdir import write_atomically

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPOSITORY, 'benchmarks', 'results')  # the default --out, wherever a script is started


def cifar_like(num_clients: int, samples_per_client: int, seed: int = 0, partition: str = 'iid',
               alpha: float = 0.1) -> FederatedData:
  """Synthetic CIFAR-shaped data (32x32x3, 10 classes, pixels of 256 levels as CIFAR's bytes: each class a smooth
  random template plus noise) over clients by `partition` ('iid': every client every class; 'dirichlet':
  HtFLlib's practical split at `alpha`, a few classes per client and uneven sizes), 75% of each client's rows
  train. Made in blocks of float32, so that a pool of millions of rows fits in memory."""
  rng = np.random.default_rng(seed)
  coarse = rng.normal(size=(10, 8, 8, 3)).astype(np.float32)
  templates = np.repeat(np.repeat(coarse, 4, 1), 4, 2)
  total = int(round(num_clients * samples_per_client / 0.8))  # make_synthetic's 20% global test rows
  y = rng.integers(0, 10, size=total).astype(np.int32)
  x = np.empty((total, 32, 32, 3), np.float32)
  for start in range(0, total, 1 << 15):
    block = y[start:start + (1 << 15)]
    pixels = np.tanh(templates[block] + 0.5 * rng.standard_normal((len(block), 32, 32, 3), dtype=np.float32))
    x[start:start + len(block)] = normalize_uint8(np.round((pixels + 1.0) * 127.5).astype(np.uint8))
  test = total - num_clients * samples_per_client
  ds = Dataset('synthetic', x[test:], y[test:], 10, x[:test], y[:test])
  return make_federated_data(ds, num_clients, partition, seed=seed, alpha=alpha)


def sgd_step_fn(model, params: Any, learning_rate: float = 0.01, model_state: Any = None
                ) -> tuple[Callable, tuple]:
  """(step(carry, x, y) -> (carry, loss), initial carry): the step of the CE client program every method built
  with `sgd_program` runs, for one model (with its non-trainable `model_state`, e.g. BatchNorm's statistics);
  carry[0] is the client (its params: carry[0].params)."""
  program = sgd_program(cross_entropy_loss(model), LocalTraining(learning_rate))
  key = jax.random.PRNGKey(0)
  step = lambda c, xb, yb: program.stages[0].step(c, Batch(xb, yb), None, key)
  return step, program.init(ClientState(params, model_state or {}, {}, key), None, key)


class CompileLog:
  """Context manager collecting the durations of XLA backend compilations while it is open."""

  def __enter__(self):
    self.durations: list[float] = []
    self._listener = lambda event, duration, **kw: (self.durations.append(duration)
                                                    if 'backend_compile' in event else None)
    jax.monitoring.register_event_duration_secs_listener(self._listener)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listener)


def best_seconds(fn: Callable[[], Any], repeats: int = 3) -> float:
  """The fastest of `repeats` timed calls of fn (blocked until its result is ready), after one warm-up call."""
  jax.block_until_ready(fn())
  best = float('inf')
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - t0)
  return best


def cpu_model() -> str:
  """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def cpu_vector_extension(flags: str | None = None) -> str:
  """The widest vector instructions the CPU has, from /proc/cpuinfo's flags (or `flags`): 'avx512' (AVX-512F),
  'avx2', 'avx', 'sve', 'neon' (asimd), else ''. Two CPUs of one model name can differ here (and oneDNN's kernels,
  and so the figures, with them)."""
  if flags is None:
    try:
      with open('/proc/cpuinfo') as f:
        flags = next((line.split(':', 1)[1] for line in f if line.startswith(('flags', 'Features'))), '')
    except OSError:
      flags = ''
  have = set(flags.split())
  return next((name for name, flag in (('avx512', 'avx512f'), ('avx2', 'avx2'), ('avx', 'avx'), ('sve', 'sve'),
                                        ('neon', 'asimd')) if flag in have), '')


def machine() -> dict:
  """What the figures were measured on: backend, device, CPU model, vector extension and count, and the library
  versions."""
  import importlib.metadata as metadata
  versions = {}
  for package in ('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'torch', 'onednn-cpu-gomp'):
    try:
      versions[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
      pass
  device = jax.devices()[0]
  return {'backend': jax.default_backend(), 'device': str(device), 'device_kind': device.device_kind,
          'cpu_count': os.cpu_count(), 'machine': platform.machine(), 'cpu_model': cpu_model(),
          'cpu_vector': cpu_vector_extension(),
          'jax': jax.__version__, 'versions': versions}


def command_line() -> str:
  """The command that is running, as typed from the repository's root: '[JAX_PLATFORMS=...] python
  benchmarks/<script> <flags>' (JAX_PLATFORMS where it is set: it decides the backend, and PyTorch's device with
  it)."""
  script = os.path.relpath(os.path.abspath(sys.argv[0]), REPOSITORY)
  platforms = [f'JAX_PLATFORMS={shlex.quote(os.environ["JAX_PLATFORMS"])}'] if os.environ.get('JAX_PLATFORMS') else []
  return ' '.join(platforms + ['python', script] + [shlex.quote(a) for a in sys.argv[1:]])


def xla_op_label(name: str, hlo_text: str) -> str:
  """A compiled XLA op `name` of the step as '<layer> <primitive>, forward|backward|update [name]', from its
  op_name metadata (backward: it belongs to the gradient; update: the SGD step)."""
  match = re.search(r'%' + re.escape(name) + r' = [^\n]*op_name="([^"]*)"', hlo_text)
  if match is None:
    return name
  path = match.group(1)
  layer = next((seg for seg in reversed(path.split('/')) if re.fullmatch(r'(Conv|Dense)_\d+|head|extractor', seg)), '')
  phase = 'backward' if 'transpose(' in path else 'forward' if 'jvp(' in path else 'update'
  target = re.search(r'%' + re.escape(name) + r' = [^\n]*custom_call_target="([^"]*)"', hlo_text)
  what = target.group(1) if target else path.rsplit("/", 1)[-1]  # a custom call: the function it calls
  return f'{layer} {what}, {phase} [{name}]'.strip()


def write_results(out: str, name: str, settings: dict, rows: list[dict], complete: bool = True) -> None:
  """Writes out/name.json (machine, command, settings, rows) and out/name.csv (rows), each replaced whole, and
  says where. A benchmark calls it after every row with complete=False, then once with complete=True, so that a
  run stopped at a time limit keeps the rows it finished (its file says 'complete': false)."""
  os.makedirs(out, exist_ok=True)
  base = os.path.join(out, name)
  write_atomically(base + '.json', lambda f: json.dump({**machine(), 'command': command_line(), **settings,
                                                        'complete': complete, 'rows': rows}, f, indent=2))
  fields = list(dict.fromkeys(key for row in rows for key in row))

  def write_csv(f):
    writer = csv.DictWriter(f, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
  write_atomically(base + '.csv', write_csv)
  if complete:
    print('wrote', base + '.json', base + '.csv')
