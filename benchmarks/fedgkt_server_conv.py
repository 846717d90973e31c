"""FedGKT's server pass on the CPU per convolution formulation: one epoch of the server's stemless ResNet over the
clients' uploaded maps (`methods.fedgkt.server_pass`: a scan of Adam steps, each a train-mode batch of maps),
milliseconds per server step, best of 3 after a warm-up, side by side in one run.

  python benchmarks/fedgkt_server_conv.py --map_size=28 --blocks=2 --convs=xla,im2col,onednn

Maps: --map_size x --map_size x 16 (FedGKT's client stem on MNIST-sized images), --rows per client for two
clients, batches of --batch_size. XLA's own convolution inside the scan's loop body is the slow one on XLA:CPU;
the server model takes the run's --conv. Prints a table and writes benchmarks/results/fedgkt_server_conv.json/.csv.
oneDNN's row is left out, said so, where the `onednn` extra is not installed.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, best_seconds, write_results

from fedjax_het.core import Uploads
from fedjax_het.kernels import onednn
from fedjax_het.methods import FedGKTConfig
from fedjax_het.methods.fedgkt import gkt_optimizer, server_pass
from fedjax_het.models.conv import conv_factory
from fedjax_het.models.resnet import StemlessResNet

flags.DEFINE_integer('map_size', 28, 'Height and width of the uploaded maps.')
flags.DEFINE_integer('blocks', 2, 'Bottlenecks per stage of the server ResNet (6: ResNet-56).')
flags.DEFINE_integer('rows', 200, 'Uploaded rows per client (two clients).')
flags.DEFINE_integer('batch_size', 50, 'Server batch size.')
flags.DEFINE_list('convs', ['xla', 'im2col', 'onednn'], 'Convolution formulations.')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS


def server_epoch(conv: str):
  """(a jitted function running one server epoch, its argument, its number of steps)."""
  size, n, slots = FLAGS.map_size, FLAGS.rows, 2
  trunk = StemlessResNet(10, FLAGS.blocks, conv=conv_factory(conv))
  variables = trunk.init(jax.random.PRNGKey(0), jnp.zeros((2, size, size, 16)), train=False)
  optimizer = gkt_optimizer('adam', 1e-3)
  group_pass = server_pass(FedGKTConfig(server_distill=True), optimizer, trunk, FLAGS.batch_size)
  rng = np.random.default_rng(0)
  uploads = Uploads({'features': jnp.asarray(rng.normal(size=(slots, n, size, size, 16)), jnp.float32),
                     'logits': jnp.asarray(rng.normal(size=(slots, n, 10)), jnp.float32),
                     'y': jnp.asarray(rng.integers(0, 10, (slots, n)), jnp.int32), 'rows': jnp.ones((slots, n), bool)},
                    jnp.ones(slots, bool), jnp.full(slots, float(n)))
  order = jnp.tile(jnp.arange(n), (slots, 1))
  params = {'trunk': variables['params'], 'adapter': {}}
  carry = (params, {'batch_stats': variables['batch_stats']},
           {'trunk': optimizer.init(params['trunk']), 'adapter': optimizer.init({})},
           jnp.zeros((slots, n, 10)), jnp.float32(0), jnp.float32(0))
  return jax.jit(lambda c: group_pass(c, uploads, order)), carry, slots * -(-n // FLAGS.batch_size)


def main(_):
  rows = []
  for conv in FLAGS.convs:
    if conv == 'onednn' and onednn.unavailable_reason() is not None:
      print(f'onednn: left out ({onednn.unavailable_reason()})')
      continue
    run, carry, steps = server_epoch(conv)
    seconds = best_seconds(lambda: jax.block_until_ready(run(carry)))
    rows.append({'conv': conv, 'map': f'{FLAGS.map_size}x{FLAGS.map_size}x16', 'blocks': FLAGS.blocks,
                 'batch_size': FLAGS.batch_size, 'steps': steps, 'ms_per_step': round(1e3 * seconds / steps, 1)})
    write_results(FLAGS.out, 'fedgkt_server_conv', {}, rows, complete=False)
  fastest = min(r['ms_per_step'] for r in rows)
  for r in rows:
    r['x_fastest'] = round(r['ms_per_step'] / fastest, 2)
    print(f"{r['conv']:>8}: {r['ms_per_step']:8.1f} ms per server step ({r['x_fastest']}x the fastest)")
  write_results(FLAGS.out, 'fedgkt_server_conv', {}, rows)


if __name__ == '__main__':
  app_run(main)
