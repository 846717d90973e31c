"""Seconds per FedRE round for each execution strategy, side by side in one process.

  python benchmarks/strategies.py --num_clients=10 --samples_per_client=384 --models=cnn4 \
      --variants=sequential/xla/1,sequential/auto/1,sequential/auto/2,vmap/im2col,vmap/xla

Synthetic CIFAR-shaped data (32x32x3), IID over clients, FedRE with RAP. A variant is strategy/conv[/threads]
(threads: the sequential strategy's client threads). For each: compile+first-round seconds, then the mean of
--rounds warm rounds (train only, evaluation excluded). Prints a table and writes JSON.
"""

import json
import os
import platform
import time

from absl import app, flags

import jax

from fedjax_het.algorithms import FedREConfig, fedre
from fedjax_het.data import make_federated_data, make_synthetic
from fedjax_het.engine import Federation, LocalTraining

flags.DEFINE_integer('num_clients', 10, 'Clients.')
flags.DEFINE_integer('samples_per_client', 384, 'Pool samples per client (75% train).')
flags.DEFINE_list('models', ['cnn4'], 'Model family.')
flags.DEFINE_list('variants', ['sequential/auto/2', 'vmap/im2col'], 'strategy/conv[/client threads] to compare.')
flags.DEFINE_integer('chunk_size', 0, 'vmap chunk size (0 = whole group).')
flags.DEFINE_integer('batch_size', 32, 'Local batch size.')
flags.DEFINE_integer('rounds', 3, 'Warm rounds to time.')
flags.DEFINE_string('out', 'benchmarks/results', 'Folder for the JSON result.')
FLAGS = flags.FLAGS


def main(_):
  k = FLAGS.num_clients
  ds = make_synthetic(num_samples=k * FLAGS.samples_per_client, image_shape=(32, 32, 3), num_classes=10, seed=0)
  data = make_federated_data(ds, k, 'iid', seed=0)
  rows = []
  for variant in FLAGS.variants:
    strategy, conv, *threads = variant.split('/')
    fed = Federation(fedre(FedREConfig(), 10), data, FLAGS.models, LocalTraining(0.06, FLAGS.batch_size, 1),
                     strategy=strategy, chunk_size=FLAGS.chunk_size, conv=conv,
                     client_threads=int(threads[0]) if threads else None)
    state = fed.init()
    t0 = time.perf_counter()
    state, _ = fed.round(state)
    first = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.rounds):
      state, m = fed.round(state)
      times.append(m['train_seconds'])
    steps = sum(int(n) // FLAGS.batch_size for g in fed.groups for n in g.train.n)
    rows.append({'variant': variant, 'first_round_seconds': first, 'seconds_per_round': sum(times) / len(times),
                 'client_steps_per_second': steps / (sum(times) / len(times))})
    print(f"{variant:>18}: first round (with compile) {first:7.2f} s | warm round {rows[-1]['seconds_per_round']:7.3f} s"
          f" | {rows[-1]['client_steps_per_second']:8.1f} client-steps/s", flush=True)
  result = {'backend': jax.default_backend(), 'device': str(jax.devices()[0]), 'cpu_count': os.cpu_count(),
            'machine': platform.processor() or platform.machine(), 'jax': jax.__version__,
            'num_clients': k, 'models': FLAGS.models, 'batch_size': FLAGS.batch_size,
            'samples_per_client': FLAGS.samples_per_client, 'rows': rows}
  os.makedirs(FLAGS.out, exist_ok=True)
  path = os.path.join(FLAGS.out, f'strategies_{jax.default_backend()}_{k}clients_{"-".join(FLAGS.models)}.json')
  with open(path, 'w') as f:
    json.dump(result, f, indent=2)
  print('wrote', path)


if __name__ == '__main__':
  app.run(main)
