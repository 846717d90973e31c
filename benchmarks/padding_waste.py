"""Padding waste of the vmap executor: computed over useful client-steps, padded to the largest client (one vmapped
call over a whole group) against the chunk plan (engine/chunks.py), for IID and Dirichlet splits.

  python benchmarks/padding_waste.py --num_clients=10,100,1000 --alphas=0.1

A 10-class pool of --pool_rows rows (--pool_rows_per_client per client where that is larger) is split over the
clients as HtFLlib does (`data.partition.partition_clients`: IID, or Dirichlet at each alpha with its 75/25
train/test split and minimum client size); where HtFLlib's Dirichlet split cannot give every client its minimum
(1,000 clients at alpha 0.1), a plain per-class Dirichlet split without minimum is used instead and the row says
so. Each client takes (train rows // --batch_size) local steps (one epoch, drop_last). Padded: every client
computes the largest client's steps. Chunked: `plan_chunks` at the executor's widest chunk. Prints a table and
writes JSON/CSV. No device work: the plans are host arithmetic.
"""

import numpy as np
from absl import flags

from fedjax_het.run.cli import app_run

import jax

from harness import RESULTS, write_results

from fedjax_het.data.partition import partition_clients
from fedjax_het.engine.chunks import padding_waste, plan_chunks
from fedjax_het.engine.vmap_executor import VmapExecutor
from fedjax_het.errors import ConfigError

flags.DEFINE_list('num_clients', ['10', '100', '1000'], 'Client counts.')
flags.DEFINE_list('alphas', ['0.1'], 'Dirichlet concentrations (besides IID).')
flags.DEFINE_integer('pool_rows', 60000, 'Pool rows (CIFAR-10 pooled: 60,000).')
flags.DEFINE_integer('pool_rows_per_client', 0, 'At least this many pool rows per client (0: --pool_rows only).')
flags.DEFINE_integer('batch_size', 32, 'Local batch size.')
flags.DEFINE_integer('max_width', VmapExecutor.DEFAULT_MAX_WIDTH, 'Widest chunk.')
flags.DEFINE_integer('seed', 0, 'Partition seed.')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS


def plain_dirichlet_sizes(labels: np.ndarray, clients: int, alpha: float, rng: np.random.RandomState) -> np.ndarray:
  """Training rows per client of a per-class Dirichlet split without a minimum client size (75% of each client's
  rows train)."""
  sizes = np.zeros(clients, np.int64)
  for c in np.unique(labels):
    share = rng.dirichlet(np.full(clients, alpha))
    sizes += np.bincount(rng.choice(clients, size=int(np.sum(labels == c)), p=share), minlength=clients)
  return (sizes * 0.75).astype(np.int64)


def split_sizes(clients: int, partition: str, alpha: float) -> tuple[np.ndarray, str]:
  """(training rows per client, how they were split)."""
  rows = max(FLAGS.pool_rows, clients * FLAGS.pool_rows_per_client)
  labels = np.repeat(np.arange(10), rows // 10)
  try:
    split = partition_clients(labels, clients, partition, FLAGS.seed, 10, alpha=alpha)
    return np.array([len(t) for t in split.train_indices]), 'htfllib'
  except ConfigError:
    return plain_dirichlet_sizes(labels, clients, alpha, np.random.RandomState(FLAGS.seed)), 'dirichlet_no_minimum'


def main(_):
  rows = []
  print(f'{"clients":>7} {"split":>16} {"padded":>8} {"chunked":>8} {"calls":>5} {"widths":>20}', flush=True)
  for clients in [int(k) for k in FLAGS.num_clients]:
    for partition, alpha in [('iid', 0.0)] + [('dirichlet', float(a)) for a in FLAGS.alphas]:
      sizes, how = split_sizes(clients, partition, alpha)
      steps = sizes // FLAGS.batch_size
      chunks = plan_chunks(steps, FLAGS.max_width)
      padded = len(steps) * steps.max() / max(steps.sum(), 1)
      row = {'num_clients': clients, 'partition': partition, 'alpha': alpha or None, 'split': how,
             'useful_steps': int(steps.sum()), 'padded_waste': float(padded),
             'chunked_waste': float(padding_waste(steps, chunks)), 'calls': len(chunks),
             'widths': sorted({c.width for c in chunks}, reverse=True)}
      rows.append(row)
      label = partition if partition == 'iid' else f'dir({alpha:g})' + ('*' if how != 'htfllib' else '')
      print(f'{clients:7d} {label:>16} {padded:8.2f} {row["chunked_waste"]:8.3f} {len(chunks):5d} '
            f'{str(row["widths"]):>20}', flush=True)
  print('* a Dirichlet split without HtFLlib\'s minimum client size (HtFLlib\'s cannot split this pool so)')
  write_results(FLAGS.out, f'padding_waste_{jax.default_backend()}',
                {'pool_rows': FLAGS.pool_rows, 'pool_rows_per_client': FLAGS.pool_rows_per_client,
                 'batch_size': FLAGS.batch_size, 'max_width': FLAGS.max_width, 'seed': FLAGS.seed}, rows)


if __name__ == '__main__':
  app_run(main)
