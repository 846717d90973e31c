"""How XLA runs one client's local steps: host-driven jitted steps vs lax.scan (rolled and unrolled), side by side.

  python benchmarks/local_steps.py --steps=36 --model=cnn4 --out=benchmarks/results

One client, batch 32, CIFAR-shaped synthetic data, plain SGD through the engine's `sgd_step`. Prints compile and
warm seconds for each formulation and writes JSON/CSV. This is the measurement behind the CPU default strategy.
"""

import time

from absl import flags

from fedjax_het.run.cli import app_run

import jax
import jax.numpy as jnp

from harness import RESULTS, sgd_step_fn, write_results

from fedjax_het.models import build_model

flags.DEFINE_integer('steps', 36, 'Local steps.')
flags.DEFINE_integer('batch_size', 32, 'Batch size.')
flags.DEFINE_string('model', 'cnn4', 'Architecture.')
flags.DEFINE_string('conv', 'xla', 'Convolution formulation (xla, im2col, auto).')
flags.DEFINE_integer('repeats', 3, 'Warm repetitions.')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS


def main(_):
  s, b = FLAGS.steps, FLAGS.batch_size
  model = build_model(FLAGS.model, 10, 512, conv=FLAGS.conv)
  x = jax.random.normal(jax.random.PRNGKey(0), (s * b, 32, 32, 3))
  y = jax.random.randint(jax.random.PRNGKey(1), (s * b,), 0, 10)
  step, carry0 = sgd_step_fn(model, model.init(jax.random.PRNGKey(2), x[:1])['params'])
  one = jax.jit(step)

  def host_steps():
    c = carry0
    for i in range(s):
      c, _ = one(c, x[i * b:(i + 1) * b], y[i * b:(i + 1) * b])
    return c

  def scan_fn(unroll):
    def run(c):
      def body(c, i):
        return step(c, jax.lax.dynamic_slice_in_dim(x, i * b, b), jax.lax.dynamic_slice_in_dim(y, i * b, b))
      return jax.lax.scan(body, c, jnp.arange(s), unroll=unroll)[0]
    f = jax.jit(run)
    return lambda: f(carry0)

  rows = []
  for name, fn in [('host-driven jitted steps', host_steps), ('lax.scan rolled', scan_fn(1)),
                   ('lax.scan fully unrolled', scan_fn(True))]:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(FLAGS.repeats):
      jax.block_until_ready(fn())
    warm = (time.perf_counter() - t0) / FLAGS.repeats
    rows.append({'formulation': name, 'first_seconds': first, 'warm_seconds': warm})
    print(f'{name:>26}: first (incl. compile) {first:7.2f} s | warm {warm:7.3f} s', flush=True)
  write_results(FLAGS.out, f'local_steps_{jax.default_backend()}_{FLAGS.model}_{s}steps',
                {'steps': s, 'batch_size': b, 'model': FLAGS.model, 'conv': FLAGS.conv}, rows)


if __name__ == '__main__':
  app_run(main)
