"""Seconds per FedRE round for each execution variant, side by side in one process.

  python benchmarks/strategies.py --num_clients=10 --samples_per_client=384 --models=cnn4 \
      --variants=sequential/auto/2,sequential/auto/1,sequential/xla/1,vmap/im2col

Synthetic CIFAR-shaped data (32x32x3), IID over clients, FedRE with RAP. A variant is
strategy/conv[/threads[/eval rows]] (threads: the sequential strategy's client threads; eval rows: rows per
eval-mode pass; empty or absent: the default). For each: compile+first-round seconds, then the mean of
--rounds warm rounds (train only, evaluation excluded). Prints a table and writes JSON/CSV.
"""

import time

from absl import flags

from fedjax_het.run.cli import app_run

import jax

from harness import RESULTS, cifar_like, write_results

from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining
from fedjax_het.methods import FedREConfig, fedre

flags.DEFINE_integer('num_clients', 10, 'Clients.')
flags.DEFINE_integer('samples_per_client', 384, 'Pool samples per client (75% train).')
flags.DEFINE_list('models', ['cnn4'], 'Model family.')
flags.DEFINE_list('variants', ['sequential/auto/2', 'vmap/im2col'],
                  'strategy/conv[/client threads[/eval pass rows]] to compare.')
flags.DEFINE_integer('chunk_size', 0, 'vmap chunk size (0 = whole group).')
flags.DEFINE_integer('batch_size', 32, 'Local batch size.')
flags.DEFINE_integer('rounds', 3, 'Warm rounds to time.')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS


def main(_):
  k = FLAGS.num_clients
  data = cifar_like(k, FLAGS.samples_per_client)
  rows = []
  for variant in FLAGS.variants:
    strategy, conv, *rest = variant.split('/')
    threads, eval_rows = [int(v) if v else None for v in rest + [''] * (2 - len(rest))]
    fed = Federation(fedre(FedREConfig(), 10), data, FLAGS.models, LocalTraining(0.06, FLAGS.batch_size, 1),
                     ExecutionConfig(strategy=strategy, conv=conv, chunk_size=FLAGS.chunk_size,
                                     client_threads=threads, eval_batch_size=eval_rows))
    state = fed.init()
    t0 = time.perf_counter()
    state, _ = fed.round(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.rounds):
      state, m = fed.round(state)
      times.append(m['train_seconds'])
    seconds = sum(times) / len(times)
    rows.append({'variant': variant, 'eval_batch_size': fed.executor.eval_batch_size,
                 'first_round_seconds': first, 'seconds_per_round': seconds,
                 'client_steps_per_second': m['local_steps'] / seconds})
    print(f"{variant:>18}: first round (with compile) {first:7.2f} s | warm round {seconds:7.3f} s"
          f" | {rows[-1]['client_steps_per_second']:8.1f} client-steps/s", flush=True)
  write_results(FLAGS.out, f'strategies_{jax.default_backend()}_{k}clients_{"-".join(FLAGS.models)}',
                {'num_clients': k, 'models': FLAGS.models, 'batch_size': FLAGS.batch_size,
                 'samples_per_client': FLAGS.samples_per_client}, rows)


if __name__ == '__main__':
  app_run(main)
