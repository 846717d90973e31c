"""What tracing an architecture's programs costs: Python calls and seconds, for a warm start's biggest part.

  python benchmarks/trace_cost.py --archs=resnet152,vit_b16 --conv=xla

A warm start (XLA's compilation cache filled) is mostly Python: JAX tracing each group's programs and lowering
them (`docs/performance.md`). For each architecture (the classifier of `models.registry.build_model`, convolutions
computed the --conv way) this traces, without compiling, the jitted SGD step of cross-entropy on a batch of
--batch_size 32x32x3 images and an eval-mode representation pass over as many rows, each from a fresh function so
that nothing is served from JAX's trace cache: the Python calls of one trace (counted by `sys.setprofile`, which
does not change between runs on any machine) and its process seconds (the best of --repeats, which do). Run it
with two versions of the library importable in turn (`PYTHONPATH=<checkout> python benchmarks/trace_cost.py`) to
compare what a change to the models costs a start. Prints the figures and writes OUT/trace_cost_<backend>.json/.csv.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from absl import flags

from fedjax_het.models.forward import forward
from fedjax_het.models.registry import build_model
from fedjax_het.run.cli import app_run

from harness import RESULTS, sgd_step_fn, write_results

flags.DEFINE_list('archs', ['resnet152', 'vit_b16'], 'Architectures (models.registry names).')
flags.DEFINE_string('conv', 'xla', 'The convolution formulation (an ExecutionConfig.conv value).')
flags.DEFINE_integer('batch_size', 32, 'Rows of the training step and of the representation pass.')
flags.DEFINE_integer('repeats', 3, 'Timed traces per figure (the fastest is kept).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


def python_calls(fn) -> int:
  """The Python function calls made while fn() runs."""
  calls = [0]

  def count(frame, event, arg):
    if event == 'call':
      calls[0] += 1
  sys.setprofile(count)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return calls[0]


def trace_figures(make, repeats: int) -> tuple[int, float]:
  """(Python calls, best process seconds) of tracing `jax.jit(f).trace(*args)` for (f, args) = make(), a fresh f
  each time."""
  def trace():
    f, args = make()
    jax.jit(f).trace(*args)
  calls = python_calls(trace)
  best = float('inf')
  for _ in range(repeats):
    t0 = time.process_time()
    trace()
    best = min(best, time.process_time() - t0)
  return calls, best


def main(_):
  x = jnp.zeros((FLAGS.batch_size, 32, 32, 3))
  y = jnp.zeros((FLAGS.batch_size,), jnp.int32)
  settings = {'conv': FLAGS.conv, 'batch_size': FLAGS.batch_size, 'repeats': FLAGS.repeats}
  rows = []
  for arch in FLAGS.archs:
    model = build_model(arch, 10, 512, 'ap', FLAGS.conv)
    variables = model.init(jax.random.PRNGKey(0), x[:1])
    params = variables.pop('params')

    def step():
      fn, carry = sgd_step_fn(model, params, 0.01, dict(variables))
      return (lambda c, xb, yb: fn(c, xb, yb)), (carry, x, y)

    def represent():
      return (lambda p, v, xb: forward(model, p, v, xb, train=False)[1]), (params, dict(variables), x)
    step_calls, step_seconds = trace_figures(step, FLAGS.repeats)
    pass_calls, pass_seconds = trace_figures(represent, FLAGS.repeats)
    rows.append({'arch': arch, 'step_python_calls': step_calls, 'step_trace_seconds': step_seconds,
                 'pass_python_calls': pass_calls, 'pass_trace_seconds': pass_seconds})
    print(f'{arch}: training step {step_calls:,} Python calls, {step_seconds:.2f} s; eval-mode pass '
          f'{pass_calls:,} calls, {pass_seconds:.2f} s', flush=True)
    write_results(FLAGS.out, f'trace_cost_{jax.default_backend()}', settings, rows, complete=False)
  write_results(FLAGS.out, f'trace_cost_{jax.default_backend()}', settings, rows)


if __name__ == '__main__':
  app_run(main)
