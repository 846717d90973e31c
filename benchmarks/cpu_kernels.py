"""Where a local SGD step of the 4-layer CNN spends its time, and what the CPU defaults are based on.

  python benchmarks/cpu_kernels.py --parts=step,layers,pool,threads,vmap,represent,federation_step,profile

Batch 32, 32x32x3 inputs, milliseconds, best of 3 after a warm-up. Parts:
  step:            one jitted SGD step per convolution formulation (xla, im2col, auto, onednn), and PyTorch's.
  layers:          forward / kernel-gradient / input-gradient of each convolution of the CNN: XLA, im2col, oneDNN.
  pool:            gradient of 2x2 max pooling: the first-maximum pool of models/pooling.py vs a reshape and
                   reduce-max vs flax's reduce_window.
  threads:         steps of two independent clients driven from one host thread vs two (ms per client-step),
                   per formulation; oneDNN's with the default threads per convolution and with all cores.
  vmap:            one step of 10 clients vmapped (per client-step) per formulation, vs a host loop.
  represent:       eval-mode representations of 288 rows in passes of 32..288 rows (the eval batch size), per
                   formulation, and PyTorch's.
  federation_step: the Federation's own jitted step (sequential strategy) vs the standalone step, same model,
                   conv and batch shape.
  profile:         per-op profile of the default CPU step as a round runs it (two client threads on the cores, JAX's
                   profiler; each XLA op labelled with the layer and primitive it computes, 'backward' where it
                   belongs to the gradient) and of PyTorch's step (torch.profiler, self CPU time per op).
oneDNN's convolutions run with the library's default threads per call (`ExecutionConfig.onednn_threads`: the
cores divided among the default two client threads), and are left out, said so, where the `onednn` extra is not installed. Prints the figures and writes
benchmarks/results/cpu_kernels_<backend>.json/.csv.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import threading
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from fedjax_het.run.cli import app_run
from jax import lax

from harness import RESULTS, best_seconds, cifar_like, sgd_step_fn, write_results, xla_op_label

from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining
from fedjax_het.kernels import onednn
from fedjax_het.methods import FedREConfig, fedre
from fedjax_het.models import build_model
from fedjax_het.models.conv import im2col_conv_general_dilated, onednn_conv_general_dilated
from fedjax_het.models.forward import forward
from fedjax_het.models.pooling import max_pool

flags.DEFINE_list('parts', ['step', 'layers', 'pool', 'threads', 'vmap', 'represent', 'federation_step', 'profile'],
                  'What to measure.')
flags.DEFINE_integer('batch_size', 32, 'Batch size.')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS
B = 32
DEFAULT = None  # the library's CPU defaults (ExecutionConfig), set in main


def batch(rng=0, clients=None):
  shape = (B, 32, 32, 3) if clients is None else (clients, B, 32, 32, 3)
  x = np.random.default_rng(rng).normal(size=shape).astype(np.float32)
  y = np.random.default_rng(rng + 1).integers(0, 10, shape[:-3]).astype(np.int32)
  return jnp.asarray(x), jnp.asarray(y)


def step_setup(conv, seed=0):
  model = build_model('cnn4', 10, 512, conv=conv)
  step, carry = sgd_step_fn(model, model.init(jax.random.PRNGKey(seed), jnp.zeros((1, 32, 32, 3)))['params'])
  return model, jax.jit(step), carry


def ms_per_step(step, carry, x, y, steps=10):
  def run():
    c = carry
    for _ in range(steps):
      c, _ = step(c, x, y)
    return c
  return best_seconds(run) / steps * 1e3


def torch_sgd_step(x, y, part: str):
  """One SGD step of PyTorch's 4-layer CNN on the batch (x, y) as a function, or None (said) without torch."""
  try:
    import torch
    import torch.nn.functional as F
    from torch_reference import TorchCNN4
  except ImportError:
    print(f'{part}: torch not installed, PyTorch not measured (pip install -e ".[torch]")')
    return None
  model = TorchCNN4()
  opt = torch.optim.SGD(model.parameters(), lr=0.01)
  tx = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())
  ty = torch.from_numpy(np.asarray(y).astype(np.int64))

  def step():
    opt.zero_grad()
    F.cross_entropy(model(tx), ty).backward()
    opt.step()
  return step


def formulations(*names):
  """`names`, less 'onednn' (said) where oneDNN cannot run here."""
  if 'onednn' in names and onednn.unavailable_reason() is not None:
    print(f'onednn not measured: {onednn.unavailable_reason()}')
    return tuple(n for n in names if n != 'onednn')
  return names


def part_step(rows):
  x, y = batch()
  for conv in formulations('xla', 'im2col', 'auto', 'onednn'):
    _, step, carry = step_setup(conv)
    rows.append({'part': 'step', 'case': f'jax {conv}', 'ms': ms_per_step(step, carry, x, y)})
  torch_step = torch_sgd_step(x, y, 'step')
  if torch_step is None:
    return
  import torch

  def torch_steps():
    for _ in range(10):
      torch_step()
  rows.append({'part': 'step', 'case': f'torch {torch.__version__} ({torch.get_num_threads()} threads)',
               'ms': best_seconds(torch_steps) / 10 * 1e3})


def part_layers(rows):
  rng = np.random.default_rng(0)
  for h, c, o in [(32, 3, 32), (14, 32, 64)]:
    x = jnp.asarray(rng.normal(size=(B, h, h, c)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(5, 5, c, o)).astype(np.float32))
    impls = {'xla': lax.conv_general_dilated, 'im2col': im2col_conv_general_dilated,
             'onednn': onednn_conv_general_dilated}
    for name in formulations(*impls):
      fn = impls[name]
      conv = lambda x, k, fn=fn: fn(x, k, (1, 1), 'VALID', dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
      fwd = jax.jit(conv)
      dk = jax.jit(jax.grad(lambda k, x: jnp.sum(conv(x, k) ** 2)))
      dx = jax.jit(jax.grad(lambda x, k: jnp.sum(conv(x, k) ** 2)))
      for what, f, args in [('forward', fwd, (x, k)), ('kernel grad', dk, (k, x)), ('input grad', dx, (x, k))]:
        rows.append({'part': 'layers', 'case': f'conv {c}->{o} at {h}x{h} {name} {what}',
                     'ms': best_seconds(lambda: f(*args)) * 1e3})


def part_pool(rows):
  x = jnp.asarray(np.random.default_rng(0).normal(size=(B, 28, 28, 32)).astype(np.float32))
  reshape_max = lambda x: x.reshape(x.shape[0], x.shape[1] // 2, 2, x.shape[2] // 2, 2, x.shape[3]).max(axis=(2, 4))
  for name, pool in [('first maximum by index (models/pooling.py)', lambda x: max_pool(x, (2, 2), (2, 2))),
                     ('reshape and reduce-max', reshape_max),
                     ('flax reduce_window', lambda x: nn.max_pool(x, (2, 2), (2, 2)))]:
    g = jax.jit(jax.grad(lambda x, pool=pool: jnp.sum(jnp.sin(pool(jax.nn.relu(x))))))
    rows.append({'part': 'pool', 'case': f'max pool 2x2 gradient, {name}', 'ms': best_seconds(lambda: g(x)) * 1e3})


def two_clients(conv, x, y):
  """(the jitted `conv` step, the two clients' initial carries (seeds 0 and 1), chain(i, n)): chain runs n steps of
  client i on the batch (x, y) to completion."""
  _, step, carry = step_setup(conv)
  carries = [carry, step_setup(conv, seed=1)[2]]

  def chain(i, n):
    c = carries[i]
    for _ in range(n):
      c, _ = step(c, x, y)
    jax.block_until_ready(c)
  return step, carries, chain


def in_two_threads(chain, n):
  """chain(0, n) and chain(1, n) at once, one host thread each."""
  threads = [threading.Thread(target=chain, args=(i, n)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()


def part_threads(rows):
  x, y = batch()
  steps = 10
  cases = [(conv, None) for conv in formulations('auto', 'im2col')]
  if formulations('onednn'):  # oneDNN with the default threads per call, and with every core per call
    cases += [('onednn', t) for t in dict.fromkeys([DEFAULT.onednn_threads, os.cpu_count() or 1])]
  for conv, onednn_threads in cases:
    if onednn_threads:
      onednn.set_threads(onednn_threads)
    _, _, chain = two_clients(conv, x, y)
    chain(0, steps)
    label = conv + (f' ({onednn_threads} thread{"s" if onednn_threads > 1 else ""} per convolution)'
                    if onednn_threads else '')
    for name, fn, work in [('one thread, one client', lambda: chain(0, steps), steps),
                           ('one thread, two clients in turn', lambda: (chain(0, steps), chain(1, steps)), 2 * steps),
                           ('two threads, one client each', lambda: in_two_threads(chain, steps), 2 * steps)]:
      ms = best_seconds(fn) / work * 1e3
      cpu0, t0 = time.process_time(), time.perf_counter()
      fn()
      rows.append({'part': 'threads', 'case': f'{label}: {name}', 'ms': ms,
                   'cpu_over_wall': (time.process_time() - cpu0) / (time.perf_counter() - t0)})
  DEFAULT.apply_process_settings()


def part_vmap(rows):
  clients = 10
  x, y = batch(clients=clients)
  for conv in ('xla', 'im2col'):
    model = build_model('cnn4', 10, 512, conv=conv)
    params = jax.vmap(lambda k: model.init(k, x[0])['params'])(jax.random.split(jax.random.PRNGKey(0), clients))
    raw, _ = sgd_step_fn(model, jax.tree.map(lambda a: a[0], params))
    vstep = jax.jit(jax.vmap(raw))
    vcarry = jax.vmap(lambda p: sgd_step_fn(model, p)[1])(params)
    rows.append({'part': 'vmap', 'case': f'vmap over {clients} clients, {conv}',
                 'ms': ms_per_step(vstep, vcarry, x, y, steps=3) / clients})
  _, step, carry = step_setup('auto')

  def loop():
    out = []
    for i in range(clients):
      out.append(step(carry, x[i], y[i]))
    return out
  rows.append({'part': 'vmap', 'case': f'host loop over {clients} clients, auto',
               'ms': best_seconds(loop) / clients * 1e3})


def part_represent(rows):
  rows_total, chunks = 288, (16, 32, 48, 64, 144, 288)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(rows_total, 32, 32, 3)).astype(np.float32))
  for conv in formulations('auto', 'xla', 'im2col', 'onednn'):
    model = build_model('cnn4', 10, 512, conv=conv)
    params = model.init(jax.random.PRNGKey(0), x[:1])['params']
    represent = jax.jit(lambda p, xb, model=model: forward(model, p, {}, xb, False)[1])
    for chunk in chunks:
      run = lambda chunk=chunk: [represent(params, x[s:s + chunk]) for s in range(0, rows_total, chunk)]
      rows.append({'part': 'represent', 'case': f'{rows_total} rows in passes of {chunk}, {conv}',
                   'ms': best_seconds(run) * 1e3})
  try:
    import torch
    from torch_reference import TorchCNN4
  except ImportError:
    print('represent: torch not installed, PyTorch not measured (pip install -e ".[torch]")')
    return
  model = TorchCNN4().eval()
  tx = torch.from_numpy(np.asarray(x).transpose(0, 3, 1, 2).copy())
  for chunk in chunks:
    def run(chunk=chunk):
      with torch.no_grad():
        return [model.represent(xb) for xb in torch.split(tx, chunk)]
    rows.append({'part': 'represent', 'case': f'{rows_total} rows in passes of {chunk}, torch',
                 'ms': best_seconds(run) * 1e3})


def part_federation_step(rows):
  fed = Federation(fedre(FedREConfig(), 10), cifar_like(4, 384), ['cnn4'], LocalTraining(0.01, B, 1),
                   ExecutionConfig(strategy='sequential', conv=DEFAULT.conv, client_threads=1))
  state, _ = fed.round(fed.init())
  g = fed.groups[0]
  fns = fed.executor.functions(g, fed.programs[0][0], 0)
  client = fed.executor.stack_functions()['take'](state.groups[0], 0)
  broadcast = fed.broadcast(state.server, 0, 0)
  key = jax.random.PRNGKey(0)
  stage = fns['stages'][0]
  n = int(g.train_sizes[0])
  schedule = stage['schedule'](key, n)
  carry = fns['init'](client, broadcast, key)
  steps = n // B

  def federation_steps():
    c = carry
    for t in range(steps):
      c, _ = stage['step'](c, t, schedule, g.train.x, g.train.y, 0, n, broadcast, key)
    return c
  rows.append({'part': 'federation_step',
               'case': "Federation fns['stages'][0]['step'] (FedRE loss, batch gathered in jit)",
               'ms': best_seconds(federation_steps) / steps * 1e3})
  _, step, _ = step_setup(DEFAULT.conv)
  xb, yb = g.train.x[0][schedule[0]], g.train.y[0][schedule[0]]
  rows.append({'part': 'federation_step', 'case': 'standalone step, same params and first batch',
               'ms': ms_per_step(step, carry, xb, yb, steps=steps)})


def part_profile(rows, steps=20):
  x, y = batch()
  step, carries, chain = two_clients(DEFAULT.conv, x, y)
  hlo_text = step.lower(carries[0], x, y).compile().as_text()
  chain(0, 3)
  chain(1, 3)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    start = time.perf_counter()
    in_two_threads(chain, steps)
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    events = json.load(gzip.open(glob.glob(f'{trace_dir}/**/*.trace.json.gz', recursive=True)[0]))['traceEvents']
  per_op = collections.defaultdict(float)
  for e in events:
    if e.get('ph') != 'X' or e['name'].startswith('$'):
      continue
    if re.fullmatch(r'[a-z_-]+(\.\d+)?', e['name']):  # XLA's instruction names (ffi_call.3)
      slices = e['name'].startswith('wrapped_slice')
      per_op['Conv_0 im2col patch slices, forward' if slices else xla_op_label(e['name'], hlo_text)] += e['dur']
  client_steps = 2 * steps
  rows.append({'part': 'profile', 'case': 'jax: a client thread\'s step (two threads share the cores)',
               'ms': wall / steps * 1e3})
  for label, us in sorted(per_op.items(), key=lambda kv: -kv[1])[:12]:
    rows.append({'part': 'profile', 'case': f'jax: {label}', 'ms': us / client_steps / 1e3})
  # What the trace does not show as an op: XLA's own (Eigen) convolutions, traced only as their launch, dispatch,
  # and the waits for a free core.
  rows.append({'part': 'profile', 'case': 'jax: between traced ops (untraced work, dispatch, waits for a core)',
               'ms': wall / steps * 1e3 - sum(per_op.values()) / client_steps / 1e3})
  torch_step = torch_sgd_step(x, y, 'profile')
  if torch_step is None:
    return
  import torch
  for _ in range(3):
    torch_step()
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(steps):
      torch_step()
  averages = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)
  rows.append({'part': 'profile', 'case': f'torch: the step ({torch.get_num_threads()} threads)',
               'ms': sum(a.self_cpu_time_total for a in averages) / steps / 1e3})
  for a in averages[:8]:
    rows.append({'part': 'profile', 'case': f'torch: {a.key}', 'ms': a.self_cpu_time_total / steps / 1e3})


def main(_):
  global B, DEFAULT
  B = FLAGS.batch_size
  DEFAULT = ExecutionConfig().resolve('cpu')
  DEFAULT.apply_process_settings()
  rows = []
  parts = {'step': part_step, 'layers': part_layers, 'pool': part_pool, 'threads': part_threads,
           'vmap': part_vmap, 'represent': part_represent, 'federation_step': part_federation_step,
           'profile': part_profile}
  for name in FLAGS.parts:
    start = len(rows)
    parts[name](rows)
    for row in rows[start:]:
      extra = f'  (CPU time / wall {row["cpu_over_wall"]:.2f})' if 'cpu_over_wall' in row else ''
      print(f'{row["part"]:>15} | {row["case"]:<60} | {row["ms"]:8.2f} ms{extra}', flush=True)
  write_results(FLAGS.out, f'cpu_kernels_{jax.default_backend()}',
                {'batch_size': B, 'xla_flags': os.environ.get('XLA_FLAGS', ''), 'default_conv': DEFAULT.conv,
                 'onednn': None if onednn.unavailable_reason() else onednn.version(),
                 'onednn_threads': DEFAULT.onednn_threads}, rows)


if __name__ == '__main__':
  app_run(main)
