"""Where oneDNN's time goes in one architecture's training step and representation pass: its primitives by kind.

  python benchmarks/onednn_profile.py --arch=resnet152

Runs, in a child process with oneDNN's verbose log on (ONEDNN_VERBOSE=profile_exec), --warmup jitted SGD steps and
representation passes of the classifier (oneDNN's convolutions, every core per call; as `arch_steps.py`), then one
of each between markers, and sums the log's execution times of that one step and that one pass by primitive kind
(convolution forward / backward_data / backward_weights by implementation, and the reorders of kernels between
JAX's HWIO layout and oneDNN's blocked ones). Milliseconds of one call each; prints them and writes
OUT/onednn_profile_<arch>.json/.csv.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, write_results

flags.DEFINE_string('arch', 'resnet152', 'Architecture (a models.registry name).')
flags.DEFINE_integer('batch_size', 32, 'Rows of the training step.')
flags.DEFINE_integer('rows', 33, 'Rows of the representation pass.')
flags.DEFINE_integer('warmup', 3, 'Calls of each before the profiled one.')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
flags.DEFINE_string('child', None, 'Internal: the pass to run with the log on (step or represent).')
FLAGS = flags.FLAGS
MARK = 'ONEDNN_PROFILE_MARK'


def child(which: str) -> None:
  """Runs the warm-up calls, then one call between two markers on stdout."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from fedjax_het.kernels import onednn
  from fedjax_het.models.forward import forward
  from fedjax_het.models.registry import build_model
  onednn.set_threads(0)
  model = build_model(FLAGS.arch, 10, conv='onednn')
  rows = FLAGS.batch_size if which == 'step' else FLAGS.rows
  x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 32, 32, 3)), jnp.float32)
  variables = model.init(jax.random.PRNGKey(0), x[:2])
  params = variables.pop('params')
  if which == 'step':
    fn = jax.jit(lambda p, s, x: jax.grad(lambda p: jnp.sum(forward(model, p, s, x, True)[0]))(p))
  else:
    fn = jax.jit(lambda p, s, x: forward(model, p, s, x, False)[1])
  for _ in range(FLAGS.warmup):
    jax.block_until_ready(fn(params, dict(variables), x))
  print(MARK, flush=True)
  jax.block_until_ready(fn(params, dict(variables), x))
  print(MARK, flush=True)


def profile(which: str) -> dict:
  """{primitive kind: milliseconds} of one profiled call of `which`."""
  env = dict(os.environ, ONEDNN_VERBOSE='profile_exec')
  done = subprocess.run([sys.executable, __file__, f'--child={which}', f'--arch={FLAGS.arch}',
                         f'--batch_size={FLAGS.batch_size}', f'--rows={FLAGS.rows}', f'--warmup={FLAGS.warmup}'],
                        env=env, capture_output=True, text=True, check=True)
  lines = done.stdout.split(MARK)[1].splitlines()
  kinds, counts = collections.Counter(), collections.Counter()
  for line in lines:
    parts = line.strip().split(',')
    if len(parts) > 6 and parts[0] == 'onednn_verbose' and parts[1] == 'exec':
      kind = parts[3] if parts[3] == 'reorder' else f'{parts[3]} {parts[5]} ({parts[4]})'
      kinds[kind] += float(parts[-1])
      counts[kind] += 1
  return {kind: (ms, counts[kind]) for kind, ms in kinds.most_common()}


def main(_):
  if FLAGS.child:
    child(FLAGS.child)
    return
  out = []
  for which in ('step', 'represent'):
    kinds = profile(which)
    total = sum(ms for ms, _ in kinds.values())
    print(f'{FLAGS.arch} {which}: {total:.1f} ms in oneDNN')
    for kind, (ms, calls) in kinds.items():
      print(f'  {ms:8.1f} ms  {calls:4d} calls  {kind}')
      out.append({'arch': FLAGS.arch, 'pass': which, 'kind': kind, 'calls': calls, 'ms': ms, 'pass_total_ms': total})
  write_results(FLAGS.out, f'onednn_profile_{FLAGS.arch}', {'batch_size': FLAGS.batch_size, 'rows': FLAGS.rows},
                out)


if __name__ == '__main__':
  app_run(main)
