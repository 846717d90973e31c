"""DDPM sampling throughput (images / s) of GeFL's generator: the whole reverse process (`lax.fori_loop` of T U-Net
passes, classifier-free guidance doubling them when w > 0) at the offline size and at the paper's size.

  python benchmarks/ddpm_sampling.py [--batch=64 --paper_batch=8]

Cases: offline (U-Net n = 8, T = 30, the gefl_mnist5k flag file's DDPM), the paper's MNIST DDPM (n = 128,
7,568,641 parameters, T = 100) with w = 0 and w = 2. Random weights (throughput does not depend on them); one
warm-up call, then the best of 3. Writes benchmarks/results/ddpm_sampling_<backend>.json/.csv.
"""

import jax
import jax.numpy as jnp
from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, best_seconds, write_results
from fedjax_het.generators import ddpm

flags.DEFINE_integer('batch', 64, 'Images per sampler call at the offline size (the target batch).')
flags.DEFINE_integer('paper_batch', 8, 'Images per sampler call at the paper size (small: it is slow on CPU).')
flags.DEFINE_string('out', RESULTS, 'Output folder.')
FLAGS = flags.FLAGS


def main(argv):
  cases = [('offline n=8 T=30 w=0', dict(width=8, steps=30, guidance=0.0), FLAGS.batch),
           ('paper n=128 T=100 w=0', dict(width=128, steps=100, guidance=0.0), FLAGS.paper_batch),
           ('paper n=128 T=100 w=2', dict(width=128, steps=100, guidance=2.0), FLAGS.paper_batch)]
  rows = []
  for name, kw, batch in cases:
    gen = ddpm(10, **kw)
    variables = gen.init(jax.random.PRNGKey(0))
    sample = jax.jit(gen.sample)
    labels = jnp.arange(batch) % 10
    seconds = best_seconds(lambda: sample(variables, labels, jax.random.PRNGKey(1)))
    rows.append({'case': name, 'batch': batch, 'seconds': seconds, 'images_per_second': batch / seconds})
    print(f'{name}: {batch} images in {seconds:.2f} s = {batch / seconds:.2f} images/s', flush=True)
  write_results(FLAGS.out, f'ddpm_sampling_{jax.default_backend()}', {'repeats': 3}, rows)


if __name__ == '__main__':
  app_run(main)
