"""A population larger than the memory budget: FedRE over many clients with their states and rows streamed from
the host, under a fixed device-memory budget, against client count.

  python benchmarks/population.py --num_clients=10,100,1000,10000 --memory_budget_mib=24

Synthetic 8x8x3 images of byte pixels (4 classes), --rows_per_client rows per client (75% train), one small CNN
(`small_cnn_narrow`), batch 8, FedRE with the vmap executor and `--stream_clients`. Per client count: the bytes of
the clients' rows and of their states (both on the host), the budget, the widest chunk the budget allows, XLA's
compiled peak of a call at the two narrowest widths and the linear estimate of the widest's, seconds per round
and the accuracy after the last round. The compiled peak stays flat once the population is larger than one
chunk: what grows with the population stays on the host. Prints a table and writes JSON/CSV.
"""

import time

import numpy as np
from absl import flags

from fedjax_het.run.cli import app_run

import jax

from harness import RESULTS, write_results

from fedjax_het.data import make_federated_data, make_synthetic
from fedjax_het.data.datasets import normalize_uint8
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.engine.stores import nbytes
from fedjax_het.methods import FedREConfig, fedre
from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache

flags.DEFINE_list('num_clients', ['10', '100', '1000', '10000'], 'Client counts.')
flags.DEFINE_integer('rows_per_client', 32, 'Pool rows per client (75% train).')
flags.DEFINE_float('memory_budget_mib', 24.0, 'Device memory a vmapped call may use.')
flags.DEFINE_integer('rounds', 2, 'Rounds per client count.')
flags.DEFINE_string('compilation_cache', DEFAULT_DIRECTORY, 'XLA\'s persistent compilation cache (empty: off).')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS


def population(clients: int):
  """Synthetic 8x8x3 byte-valued images, HtFLlib's IID split over `clients`."""
  ds = make_synthetic(num_samples=clients * FLAGS.rows_per_client, image_shape=(8, 8, 3), num_classes=4, noise=0.3,
                      seed=1)
  to_bytes = lambda a: normalize_uint8(np.round((a + 1.0) * 127.5).astype(np.uint8))
  ds = ds.__class__(ds.name, to_bytes(ds.x), ds.y, ds.num_classes, to_bytes(ds.x_test), ds.y_test)
  return make_federated_data(ds, clients, 'iid', seed=0)


def main(_):
  use_compilation_cache(FLAGS.compilation_cache)
  budget = int(FLAGS.memory_budget_mib * 2**20)
  rows = []
  print(f'{"clients":>7} {"rows MiB":>9} {"states MiB":>10} {"budget MiB":>10} {"widest":>6} {"peak@1 MiB":>10} '
        f'{"peak@4 MiB":>10} {"peak@widest":>11} {"s/round":>8} {"accuracy":>8}', flush=True)
  for clients in [int(k) for k in FLAGS.num_clients]:
    data = population(clients)
    fed = Federation(fedre(FedREConfig(), 4), data, ModelConfig(('small_cnn_narrow',), feature_dim=16),
                     LocalTraining(0.05, 8, 1), ExecutionConfig(strategy='vmap', stream_clients=True,
                                                                memory_budget=budget), seed=0)
    state = fed.init()
    times = []
    for _ in range(FLAGS.rounds):
      t0 = time.perf_counter()
      state, m = fed.round(state)
      times.append(time.perf_counter() - t0)
    accuracy = fed.evaluate(state)['accuracy']
    g = fed.groups[0]
    analysis = fed.executor.analysis[0]
    widest = max(fed.executor.widest.values())
    (w1, w2), (p1, p2) = analysis['widths'], analysis['peaks']
    row = {'num_clients': clients, 'rows_mib': (g.rows.nbytes() + g.test.rows.nbytes()) / 2**20,
           'client_states_mib': nbytes(state.groups) / 2**20, 'memory_budget_mib': FLAGS.memory_budget_mib,
           'widest_chunk': widest, f'peak_width{w1}_mib': p1 / 2**20, f'peak_width{w2}_mib': p2 / 2**20,
           'peak_widest_mib': (p1 + analysis['per_client'] * (widest - w1)) / 2**20,
           'first_round_seconds': times[0], 'seconds_per_round': float(np.mean(times[1:] or times)),
           'local_steps': m['local_steps'], 'accuracy': accuracy}
    rows.append(row)
    print(f'{clients:7d} {row["rows_mib"]:9.1f} {row["client_states_mib"]:10.1f} {FLAGS.memory_budget_mib:10.1f} '
          f'{widest:6d} {p1 / 2**20:10.2f} {p2 / 2**20:10.2f} {row["peak_widest_mib"]:11.2f} '
          f'{row["seconds_per_round"]:8.2f} {accuracy:8.3f}', flush=True)
    write_results(FLAGS.out, f'population_{jax.default_backend()}', {'rows_per_client': FLAGS.rows_per_client,
                                                                     'memory_budget_mib': FLAGS.memory_budget_mib,
                                                                     'rounds': FLAGS.rounds}, rows,
                  complete=len(rows) == len(FLAGS.num_clients))


if __name__ == '__main__':
  app_run(main)
