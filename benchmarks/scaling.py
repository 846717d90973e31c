"""How round cost grows with clients, architecture groups, model and batch size, for FedRE and grouped FedAvg.

  python benchmarks/scaling.py --algorithms=fedre,fedavg --num_clients=10,20,50,100,200 --groups=1 \\
      --models=cnn4 --batch_sizes=32 --rounds=2

Every combination of the swept values runs: synthetic CIFAR-shaped data (32x32x3, 10 classes, IID,
`--samples_per_client` pool rows), placed on device once (it never leaves between rounds). With G groups,
client k gets architecture k % G of the family `--models` followed by --group_family (so G distinct
architectures). Reported per row: initialisation (s, with its compilations); first round incl. compile (s);
compile seconds of the first round (summed over the client threads that compile concurrently); compilations
(first round and later rounds); warm seconds per round; useful client-steps per second (the steps the clients
take, not the masked ones a vmapped call computes besides); the vmap executor's padding waste (computed over
useful slot-steps of the last round's chunks); and peak memory: the device's peak_bytes_in_use where the
backend reports it (GPU/TPU), else the process's peak resident set (CPU); both only grow within a process, so a
row's peak is its own where the rows before it needed less (one algorithm per process, as benchmarks/gpu_sweep.sh
runs it, client counts ascending). A configuration that runs out of
memory is recorded as such and the sweep goes on without its larger client counts. Client counts are the outer
loop and the results files are rewritten after every row, so a sweep stopped at a time limit keeps every
configuration's smaller sizes. Writes benchmarks/results/scaling_<backend>.json and .csv.
"""

import resource
import time

from absl import app, flags

from fedjax_het.run.cli import app_run

import jax

from harness import CompileLog, RESULTS, cifar_like, write_results

from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining
from fedjax_het.engine.stores import nbytes
from fedjax_het.methods import FedREConfig, fedavg_grouped, fedre
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache

flags.DEFINE_list('algorithms', ['fedre', 'fedavg'], 'fedre and/or fedavg (grouped).')
flags.DEFINE_list('num_clients', ['10', '20'], 'Client counts.')
flags.DEFINE_list('groups', ['1'], 'Architecture-group counts.')
flags.DEFINE_list('models', ['cnn4'], 'First architecture of the family (one row set per model).')
flags.DEFINE_list('group_family', ['resnet10', 'small_cnn', 'resnet18', 'small_cnn_narrow', 'resnet34', 'mlp',
                                    'resnet8', 'resnet6', 'resnet4'],
                  'Architectures added, in order, when --groups > 1.')
flags.DEFINE_list('batch_sizes', ['32'], 'Local batch sizes.')
flags.DEFINE_integer('samples_per_client', 384, 'Pool rows per client (75% train).')
flags.DEFINE_integer('max_pool_rows', 0, 'Cap on the pool: at most this many rows in all, fewer per client where '
                     'K * --samples_per_client exceeds it (0: no cap).')
flags.DEFINE_enum('partition', 'iid', ['iid', 'dirichlet'], 'How the pool is split over clients.')
flags.DEFINE_float('alpha', 0.1, 'Dirichlet concentration for --partition=dirichlet.')
flags.DEFINE_integer('rounds', 2, 'Warm rounds timed after the first.')
flags.DEFINE_string('strategy', None, 'Execution strategy (default: the backend default).')
flags.DEFINE_enum('conv', None, list(CONV_IMPLS), 'Convolution formulation (default: the backend default).')
flags.DEFINE_bool('stream_clients', False, 'Client states and rows on the host, streamed chunk by chunk.')
flags.DEFINE_integer('group_threads', None, 'Groups initialised and compiled at once (default: the cores).')
flags.DEFINE_float('memory_budget_gib', 0.0, 'Device memory a vmapped call may use (0: the backend default).')
flags.DEFINE_float('learning_rate', 0.01, 'Local learning rate.')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
flags.DEFINE_string('compilation_cache', DEFAULT_DIRECTORY, 'XLA\'s persistent compilation cache (as the '
                    'experiments\' flag; empty: off). A first run on a machine measures cold compilations.')
FLAGS = flags.FLAGS


def peak_memory_bytes() -> tuple[int, str]:
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use']), 'device_peak'
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, 'host_peak_rss'


def samples_per_client(k: int) -> int:
  """Pool rows per client: --samples_per_client, fewer where the pool would pass --max_pool_rows."""
  if FLAGS.max_pool_rows and k * FLAGS.samples_per_client > FLAGS.max_pool_rows:
    return max(FLAGS.max_pool_rows // k, 8)
  return FLAGS.samples_per_client


def measure(algorithm: str, k: int, groups: int, model: str, batch: int) -> dict:
  family = ([model] + [m for m in FLAGS.group_family if m != model])[:groups]
  alg = fedre(FedREConfig(), 10) if algorithm == 'fedre' else fedavg_grouped(10)
  per_client = samples_per_client(k)
  data = cifar_like(k, per_client, partition=FLAGS.partition, alpha=FLAGS.alpha)
  t0 = time.perf_counter()
  with CompileLog() as compiles:
    budget = int(FLAGS.memory_budget_gib * 2**30) or None
    fed = Federation(alg, data, family, LocalTraining(FLAGS.learning_rate, batch, 1),
                     ExecutionConfig(strategy=FLAGS.strategy, conv=FLAGS.conv, stream_clients=FLAGS.stream_clients,
                                     memory_budget=budget, group_threads=FLAGS.group_threads))
    state = fed.init()
    jax.block_until_ready(state)
    init_seconds, init_compiles = time.perf_counter() - t0, list(compiles.durations)
    t0 = time.perf_counter()
    state, m = fed.round(state)
    first = time.perf_counter() - t0
    first_compiles = list(compiles.durations)[len(init_compiles):]
    times = []
    for _ in range(FLAGS.rounds):
      state, m = fed.round(state)
      times.append(m['train_seconds'])
  seconds = sum(times) / len(times)
  memory, memory_kind = peak_memory_bytes()
  computed = useful = 0
  for (name, _), (work, chunks) in getattr(fed.executor, 'last_plan', {}).items():
    if name == 'train':
      useful += int(work.sum())
      computed += sum(c.width * c.work for c in chunks)
  dataset_bytes = sum(g.rows.nbytes() + g.test.rows.nbytes() for g in fed.groups)
  state_bytes = sum(nbytes(s) for s in state.groups)
  return {'samples_per_client': per_client, 'init_seconds': init_seconds, 'dataset_mib': dataset_bytes / 2**20,
          'client_states_mib': state_bytes / 2**20, 'widest_chunk': max(getattr(fed.executor, 'widest', {0: 0}).values(),
                                                                      default=None),
          'train_loss': m['train_loss'],
          'init_compilations': len(init_compiles), 'init_compile_seconds': sum(init_compiles),
          'first_round_seconds': first, 'compile_seconds': sum(first_compiles),
          'padding_waste': computed / useful if useful else None,
          'compilations_first_round': len(first_compiles),
          'compilations_later_rounds': len(compiles.durations) - len(init_compiles) - len(first_compiles),
          'seconds_per_round': seconds,
          'local_steps': m['local_steps'], 'client_steps_per_second': m['local_steps'] / seconds,
          'peak_memory_mib': memory / 2**20, 'memory_kind': memory_kind, 'strategy': fed.strategy,
          'conv': fed.conv, 'family': '+'.join(family)}


def main(_):
  use_compilation_cache(FLAGS.compilation_cache)
  groups_swept = [int(v) for v in FLAGS.groups]
  for model in FLAGS.models:
    architectures = len(dict.fromkeys([model] + FLAGS.group_family))
    if max(groups_swept) > architectures:
      raise app.UsageError(f'--groups={max(groups_swept)} needs as many distinct architectures, but --models '
                           f'{model} with --group_family gives {architectures}. Fix: add architectures to '
                           '--group_family or sweep fewer --groups.')
  settings = {'rounds': FLAGS.rounds, 'samples_per_client': FLAGS.samples_per_client,
              'max_pool_rows': FLAGS.max_pool_rows, 'partition': FLAGS.partition}
  name = f'scaling_{jax.default_backend()}'
  rows, out_of_memory = [], set()
  header = (f'{"alg":>6} {"K":>5} {"G":>2} {"model":>8} {"B":>3} | {"init s":>6} {"first s":>7} {"compile s":>9} '
            f'{"#comp":>5} {"#later":>6} | {"s/round":>8} {"steps/s":>8} {"waste":>5} {"peak MiB":>9}')
  print(header, flush=True)
  # Client counts outermost, so that a sweep stopped at a time limit has every configuration's smaller sizes.
  for k in [int(v) for v in FLAGS.num_clients]:
    for algorithm in FLAGS.algorithms:
      for model in FLAGS.models:
        for groups in groups_swept:
          for batch in [int(v) for v in FLAGS.batch_sizes]:
            if (algorithm, model, groups, batch) in out_of_memory:
              continue  # more clients will not fit either
            row = {'algorithm': algorithm, 'num_clients': k, 'groups': groups, 'model': model, 'batch_size': batch}
            try:
              row.update(measure(algorithm, k, groups, model, batch))
            except Exception as e:  # XLA reports exhaustion as a runtime error; record it and go on.
              if 'RESOURCE_EXHAUSTED' not in str(e) and 'Out of memory' not in str(e):
                raise
              row['out_of_memory'] = True
              out_of_memory.add((algorithm, model, groups, batch))
              print(f'{algorithm:>6} {k:5d} {groups:2d} {model:>8} {batch:3d} | out of memory', flush=True)
            else:
              waste = '-' if row.get('padding_waste') is None else f'{row["padding_waste"]:.2f}'
              print(f'{algorithm:>6} {k:5d} {groups:2d} {model:>8} {batch:3d} | {row.get("init_seconds", 0.0):6.2f} '
                    f'{row["first_round_seconds"]:7.2f} {row["compile_seconds"]:9.2f} '
                    f'{row["compilations_first_round"]:5d} {row["compilations_later_rounds"]:6d} | '
                    f'{row["seconds_per_round"]:8.3f} {row["client_steps_per_second"]:8.1f} '
                    f'{waste:>5} {row["peak_memory_mib"]:9.0f}', flush=True)
            rows.append(row)
            write_results(FLAGS.out, name, settings, rows, complete=False)
  write_results(FLAGS.out, name, settings, rows)


if __name__ == '__main__':
  app_run(main)
