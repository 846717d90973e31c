"""Convolution formulations under vmap over clients: per layer and per whole training step, side by side.

  python benchmarks/vmap_conv.py --clients=64,256,1024 --formulations=xla,im2col,gemm

Every client has its own kernel, so under `jax.vmap` XLA's convolution becomes a grouped one
(feature_group_count = clients). For each layer of cnn4 (3 -> 32 and 32 -> 64, 5x5, on 32x32 and 14x14 inputs)
and a ResNet 3x3 layer (64 -> 64 on 16x16), at each client count, it times the forward pass and the forward and
backward pass (input and kernel gradients) of `--batch_size` rows per client, after one vmapped SGD step of the
whole cnn4 classifier (`--models`) per client, reported as client-steps per second. Formulations
(`fedjax_het.models.conv.CONV_IMPLS`): xla (native), im2col (patches times the kernel), gemm (XLA's forward and
input gradient, the kernel gradient one batched matmul), pallas (kernels/pallas_conv.py: no patches in memory;
Pallas's interpreter off a GPU); with --bf16, xla_bf16 runs the layer in bfloat16. A
configuration that does not fit the device's memory is recorded as such, and one that fails otherwise (a kernel
that does not compile) with its error, the others going on. Prints a table and writes JSON/CSV.
"""

import time

from absl import app, flags

from fedjax_het.run.cli import app_run

import jax
import jax.numpy as jnp
import numpy as np
import optax

from harness import RESULTS, best_seconds, write_results

from fedjax_het.models import build_model
from fedjax_het.models.conv import CONV_IMPLS
from fedjax_het.models.forward import forward

flags.DEFINE_list('clients', ['64', '256', '1024'], 'Client counts (the vmapped axis).')
flags.DEFINE_list('formulations', ['xla', 'im2col', 'gemm'], 'Convolution formulations (CONV_IMPLS).')
flags.DEFINE_bool('bf16', True, 'Also time XLA\'s convolution in bfloat16 (per layer).')
flags.DEFINE_list('layers', ['cnn4_conv1', 'cnn4_conv2', 'resnet_3x3'], 'Layers to time.')
flags.DEFINE_list('models', ['cnn4'], 'Whole classifiers whose vmapped SGD step is timed (empty: none).')
flags.DEFINE_integer('batch_size', 32, 'Rows per client.')
flags.DEFINE_integer('repeats', 5, 'Timed calls per measurement (the fastest is kept).')
flags.DEFINE_float('seconds', 0, 'Stop starting new measurements after this many seconds (0: no limit).')
flags.DEFINE_string('out', RESULTS, 'Folder for the results.')
FLAGS = flags.FLAGS

# name: (input H = W, input channels, output channels, kernel, padding)
LAYERS = {'cnn4_conv1': (32, 3, 32, 5, 'VALID'), 'cnn4_conv2': (14, 32, 64, 5, 'VALID'),
          'resnet_3x3': (16, 64, 64, 3, 'SAME')}


def conv_fn(formulation: str):
  """(lax-signature convolution, dtype) of a formulation name."""
  if formulation == 'xla_bf16':
    return jax.lax.conv_general_dilated, jnp.bfloat16
  factory = CONV_IMPLS[formulation]
  return getattr(factory, 'keywords', {}).get('conv_general_dilated', jax.lax.conv_general_dilated), jnp.float32


def layer_programs(layer: str, formulation: str, clients: int, batch: int):
  """(forward, forward+backward, arguments) of one layer vmapped over `clients`."""
  size, cin, cout, k, padding = LAYERS[layer]
  conv, dtype = conv_fn(formulation)
  x = jax.random.normal(jax.random.PRNGKey(0), (clients, batch, size, size, cin), dtype)
  w = (jax.random.normal(jax.random.PRNGKey(1), (clients, k, k, cin, cout)) / np.sqrt(k * k * cin)).astype(dtype)
  one = lambda a, b: conv(a, b, (1, 1), padding, dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
  apply = jax.vmap(one)
  loss = lambda x, w: jnp.sum(apply(x, w).astype(jnp.float32) ** 2)
  return jax.jit(apply), jax.jit(jax.grad(loss, argnums=(0, 1))), (x, w)


def step_program(model_name: str, formulation: str, clients: int, batch: int):
  """(one vmapped SGD step of every client's whole classifier, arguments)."""
  model = build_model(model_name, 10, 512, 'ap', formulation)
  x = jax.random.normal(jax.random.PRNGKey(0), (clients, batch, 32, 32, 3))
  y = jax.random.randint(jax.random.PRNGKey(1), (clients, batch), 0, 10)
  params = jax.jit(jax.vmap(lambda key: model.init(key, x[0, :1])['params']))(
      jax.random.split(jax.random.PRNGKey(2), clients))

  def step(p, x, y):
    def loss(p):
      logits = forward(model, p, {}, x, True)[0]
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    value, grad = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, g: a - 0.01 * g, p, grad), value
  return jax.jit(jax.vmap(step), donate_argnums=0), (params, x, y)


def attempt(row: dict, fill) -> dict:
  """row after fill(row) adds its measurements; where that fails (e.g. a kernel that does not compile), with
  'failed': the exception's type and first line instead, so that the other formulations go on."""
  try:
    fill(row)
  except Exception as e:
    row = {**{k: row[k] for k in ('what', 'formulation', 'clients')},
           'failed': f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}'[:300]}
  return row


def measure(fn, args, repeats: int) -> tuple[float, float]:
  """(compile seconds, fastest call seconds); (nan, nan) when the program does not fit the device's memory."""
  try:
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    compile_seconds = time.perf_counter() - t0
    if getattr(fn, '_donates', False):
      state = {'p': args[0]}

      def call():
        state['p'], loss = compiled(state['p'], *args[1:])
        return loss
      return compile_seconds, best_seconds(call, repeats)
    return compile_seconds, best_seconds(lambda: compiled(*args), repeats)
  except Exception as e:  # XlaRuntimeError RESOURCE_EXHAUSTED, or an allocation failure while compiling
    if 'RESOURCE_EXHAUSTED' in str(e) or 'Out of memory' in str(e) or 'out of memory' in str(e):
      return float('nan'), float('nan')
    raise


def main(_):
  start = time.perf_counter()
  batch, rows = FLAGS.batch_size, []
  formulations = list(FLAGS.formulations)
  unknown = [f for f in formulations if f not in CONV_IMPLS]
  if unknown:
    raise app.UsageError(f'--formulations: unknown {", ".join(unknown)}. Fix: choose from {", ".join(CONV_IMPLS)}.')
  name = f'vmap_conv_{jax.default_backend()}'
  settings = {'batch_size': batch, 'clients': FLAGS.clients, 'formulations': formulations}

  def out_of_time():
    return FLAGS.seconds and time.perf_counter() - start > FLAGS.seconds

  for clients in [int(c) for c in FLAGS.clients]:
    for model_name in FLAGS.models:
      for formulation in formulations:
        if out_of_time():
          break
        def step(row):
          fn, args = step_program(model_name, formulation, clients, batch)
          fn._donates = True
          row['compile_seconds'], row['seconds'] = measure(fn, args, FLAGS.repeats)
          row['client_steps_per_second'] = clients / row['seconds']
        row = attempt({'what': f'{model_name} step', 'formulation': formulation, 'clients': clients}, step)
        rows.append(row)
        print(f'{model_name} step  {formulation:>9} {clients:5d} clients: ' + (
            f'failed: {row["failed"]}' if 'failed' in row else
            f'{1e3 * row["seconds"]:9.2f} ms ({row["client_steps_per_second"]:9.0f} client-steps/s; compile '
            f'{row["compile_seconds"]:.1f} s)'), flush=True)
        write_results(FLAGS.out, name, settings, rows, complete=False)
    for layer in FLAGS.layers:
      for formulation in formulations + (['xla_bf16'] if FLAGS.bf16 else []):
        if out_of_time():
          break
        def passes(row):
          forward_fn, both_fn, args = layer_programs(layer, formulation, clients, batch)
          for part, fn in (('forward', forward_fn), ('forward_backward', both_fn)):
            compile_seconds, seconds = measure(fn, args, FLAGS.repeats)
            row[f'{part}_ms'] = 1e3 * seconds
            row[f'{part}_compile_seconds'] = compile_seconds
        row = attempt({'what': layer, 'formulation': formulation, 'clients': clients}, passes)
        print(f'{layer:>12} {formulation:>9} {clients:5d} clients: ' + (
            f'failed: {row["failed"]}' if 'failed' in row else
            f'forward {row["forward_ms"]:9.2f} ms, forward+backward {row["forward_backward_ms"]:9.2f} ms'), flush=True)
        rows.append(row)
        write_results(FLAGS.out, name, settings, rows, complete=False)
  write_results(FLAGS.out, name, settings, rows, complete=not out_of_time())


if __name__ == '__main__':
  app_run(main)
