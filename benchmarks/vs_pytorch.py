"""Seconds per FedRE round: fedjax_het against the HtFLlib-style PyTorch loop, in one process, alternating.

  python benchmarks/vs_pytorch.py --num_clients=10,20,50,100,200 --rounds=3

Per client count K: synthetic CIFAR-shaped data (32x32x3, 10 classes, `--samples_per_client` pool rows per client
of which 75% train; IID (every client every class, sizes within about 1.6x), or with `--partition=dirichlet`
HtFLlib's practical split: a few classes per client, sizes 30x apart), the 4-layer CNN, batch 32, 1 local epoch,
FedRE (RAP) with its server step. Both sides run the
same local SGD steps and samples (checked every round, tests/test_torch_reference.py checks the losses), after one
warm-up round each. Then `--rounds` rounds alternate: PyTorch (models in memory), PyTorch (per-round model
save/load to disk, as HtFLlib), fedjax_het; each timed to completion.

"limit": the same number of SGD steps of the same batch size, and the same eval-mode representation rows, as one
centralized model trained by one jitted step function: no federated bookkeeping. fedjax_het / limit is the
federated overhead.

Prints a table, writes benchmarks/results/vs_pytorch_<backend>.json and .csv, rewritten after every client count
(a run stopped at a time limit keeps the counts it finished).
"""

import time

import numpy as np
from absl import flags

from fedjax_het.run.cli import app_run

import jax
import jax.numpy as jnp
import torch

from harness import CompileLog, RESULTS, cifar_like, sgd_step_fn, write_results
from torch_reference import TorchFedRE, client_tensors

from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining
from fedjax_het.methods import FedREConfig, fedre
from fedjax_het.models import build_model
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.models.forward import forward

flags.DEFINE_list('num_clients', ['10', '20'], 'Client counts to sweep.')
flags.DEFINE_integer('samples_per_client', 384, 'Pool rows per client (75% train: 288 rows = 9 steps of 32).')
flags.DEFINE_enum('partition', 'iid', ['iid', 'dirichlet'], 'How the rows are split: iid (every client every class) or '
                  'dirichlet (HtFLlib\'s practical split at --alpha: few classes, uneven sizes).')
flags.DEFINE_float('alpha', 0.1, 'Dirichlet concentration for --partition=dirichlet.')
flags.DEFINE_integer('batch_size', 32, 'Local batch size.')
flags.DEFINE_integer('rounds', 3, 'Timed rounds per side (after one warm-up round).')
flags.DEFINE_string('strategy', None, 'fedjax_het strategy (default: the backend default).')
flags.DEFINE_enum('conv', None, list(CONV_IMPLS), 'fedjax_het convolution formulation (default: the backend default).')
flags.DEFINE_integer('eval_batch_size', None, 'fedjax_het rows per eval-mode pass (default: the backend default).')
flags.DEFINE_integer('client_threads', None, 'fedjax_het clients at once under the sequential strategy (default: the '
                     'library default).')
flags.DEFINE_integer('torch_eval_batch_size', 144, 'Rows per PyTorch representation pass (144: its fastest in '
                     '`cpu_kernels.py --parts=represent` on the 2-core CPU).')
flags.DEFINE_bool('disk_io', True, 'Also time the PyTorch loop with HtFLlib\'s per-round model save/load.')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


def centralized_limit(x: np.ndarray, steps: int, rep_rows: int, batch_size: int, lr: float, conv: str,
                      chunk: int) -> float:
  """Seconds for `steps` jitted SGD steps of one cnn4 plus eval-mode representations of `rep_rows` rows, one
  host thread, the same convolution formulation and representation pass size as the federation."""
  model = build_model('cnn4', 10, 512, conv=conv)
  step, carry0 = sgd_step_fn(model, model.init(jax.random.PRNGKey(0), jnp.zeros((1,) + x.shape[1:]))['params'], lr)
  step = jax.jit(step)
  represent = jax.jit(lambda p, xb: forward(model, p, {}, xb, False)[1])
  batches = max(1, min(8, x.shape[0] // batch_size))  # distinct batches cycled through (8, or what one client has)
  xs = jax.device_put(x[:batch_size * batches].reshape((batches, batch_size) + x.shape[1:]))
  ys = jnp.zeros((batches, batch_size), jnp.int32)
  xr = jax.device_put(x[:chunk])

  def run():
    carry = carry0
    for s in range(steps):
      carry, _ = step(carry, xs[s % batches], ys[s % batches])
    reps = [represent(carry[0].params, xr) for _ in range(-(-rep_rows // chunk))]
    jax.block_until_ready((carry, reps))
  run()  # compile
  t0 = time.perf_counter()
  run()
  return time.perf_counter() - t0


def main(_):
  lr = 0.01
  torch_device = 'cuda' if torch.cuda.is_available() and jax.default_backend() == 'gpu' else 'cpu'
  if torch_device == 'cuda':  # the same arithmetic on both sides: XLA computes float32 matmuls and convolutions
    torch.backends.cuda.matmul.allow_tf32 = True  # in TF32 on NVIDIA GPUs by default, PyTorch only its convolutions
    torch.backends.cudnn.allow_tf32 = True
  rows = []
  print(f'{"clients":>7} | {"torch s/round":>13} | {"torch+disk":>10} | {"fedjax_het":>10} | {"speed-up":>8} | '
        f'{"vs +disk":>8} | {"limit s":>7} | {"overhead":>8}', flush=True)
  for k in [int(v) for v in FLAGS.num_clients]:
    data = cifar_like(k, FLAGS.samples_per_client, partition=FLAGS.partition, alpha=FLAGS.alpha)
    fed = Federation(fedre(FedREConfig(), 10), data, ['cnn4'], LocalTraining(lr, FLAGS.batch_size, 1),
                     ExecutionConfig(strategy=FLAGS.strategy, conv=FLAGS.conv, eval_batch_size=FLAGS.eval_batch_size,
                                     client_threads=FLAGS.client_threads))
    g = fed.groups[0]
    tensors = client_tensors(g.train.x, g.train.y, g.train_sizes, torch_device)
    make_torch = lambda disk_io: TorchFedRE(tensors, 10, lr, FLAGS.batch_size, device=torch_device, disk_io=disk_io,
                                            eval_batch_size=FLAGS.torch_eval_batch_size)
    sides = {'torch': make_torch(False)}
    if FLAGS.disk_io:
      sides['torch_disk'] = make_torch(True)
    state = fed.init()
    with CompileLog() as compiles:
      t0 = time.perf_counter()
      state, m = fed.round(state)
      first, first_compiles = time.perf_counter() - t0, list(compiles.durations)
      for ref in sides.values():
        ref.round()
      times = {name: [] for name in list(sides) + ['fedjax_het']}
      for _ in range(FLAGS.rounds):
        for name, ref in sides.items():
          before = ref.steps, ref.samples
          t0 = time.perf_counter()
          ref.round()
          times[name].append(time.perf_counter() - t0)
          assert (ref.steps - before[0], ref.samples - before[1]) == (m['local_steps'], m['local_samples'])
        state, m = fed.round(state)
        times['fedjax_het'].append(m['train_seconds'])
    mean = {name: float(np.mean(t)) for name, t in times.items()}
    limit = centralized_limit(np.asarray(g.train.x[0]), m['local_steps'], int(g.train_sizes.sum()),
                              FLAGS.batch_size, lr, fed.conv, fed.executor.eval_batch_size)
    row = {'num_clients': k, 'local_steps': m['local_steps'], 'local_samples': m['local_samples'],
           'torch_seconds_per_round': mean['torch'],
           'torch_disk_seconds_per_round': mean.get('torch_disk'),
           'fedjax_seconds_per_round': mean['fedjax_het'],
           'speedup_vs_torch': mean['torch'] / mean['fedjax_het'],
           'speedup_vs_torch_disk': mean['torch_disk'] / mean['fedjax_het'] if 'torch_disk' in mean else None,
           'fedjax_first_round_seconds': first, 'fedjax_compile_seconds': sum(first_compiles),
           'fedjax_compilations_first_round': len(first_compiles),
           'fedjax_compilations_later': len(compiles.durations) - len(first_compiles), 'limit_seconds': limit,
           'overhead_vs_limit': mean['fedjax_het'] / limit,
           'fedjax_client_steps_per_second': m['local_steps'] / mean['fedjax_het'],
           'torch_client_steps_per_second': m['local_steps'] / mean['torch']}
    rows.append(row)
    disk = f'{row["torch_disk_seconds_per_round"]:10.3f}' if FLAGS.disk_io else f'{"-":>10}'
    vs_disk = f'{row["speedup_vs_torch_disk"]:7.2f}x' if FLAGS.disk_io else f'{"-":>8}'
    print(f'{k:7d} | {row["torch_seconds_per_round"]:13.3f} | {disk} | {row["fedjax_seconds_per_round"]:10.3f} | '
          f'{row["speedup_vs_torch"]:7.2f}x | {vs_disk} | {limit:7.3f} | {row["overhead_vs_limit"]:7.2f}x',
          flush=True)
    settings = {'torch_device': torch_device, 'torch': torch.__version__, 'torch_tf32': torch_device == 'cuda',
                'torch_threads': torch.get_num_threads(),
                'strategy': fed.strategy, 'conv': fed.conv, 'onednn_threads': fed.execution.onednn_threads,
                'client_threads': getattr(fed.executor, 'threads', None),
                'batch_size': FLAGS.batch_size, 'eval_batch_size': fed.executor.eval_batch_size,
                'torch_eval_batch_size': FLAGS.torch_eval_batch_size, 'samples_per_client': FLAGS.samples_per_client,
                'partition': FLAGS.partition, 'alpha': FLAGS.alpha if FLAGS.partition == 'dirichlet' else None,
                'rounds': FLAGS.rounds}
    write_results(FLAGS.out, f'vs_pytorch_{jax.default_backend()}', settings, rows,
                  complete=len(rows) == len(FLAGS.num_clients))


if __name__ == '__main__':
  app_run(main)
