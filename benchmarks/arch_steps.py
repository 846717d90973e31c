"""One architecture's SGD step and eval-mode representation pass, fedjax_het against PyTorch, side by side.

  python benchmarks/arch_steps.py --archs=mobilenet_v2,resnet152,vit_b16 --conv=onednn,xla

What a round of FedRE Table 1's one-client-per-architecture setting is made of on each side, per architecture
(`benchmarks/paper_settings.py` times the rounds): a jitted SGD step of cross-entropy on a batch of --batch_size
32x32x3 images (the classifier of `models.registry.build_model`, convolutions computed the --conv ways), and an
eval-mode representation pass over --rows rows; PyTorch's the same (`benchmarks/torch_reference.py`'s models, one
SGD step with zero_grad / backward / step, and a no-grad eval pass). Milliseconds, best of --repeats after a
warm-up, PyTorch's side first for every architecture (in the same process: timed after JAX's oneDNN convolutions
had run, PyTorch's steps were slower, for a reason not found). oneDNN's convolutions run with every core
per call (what a group of one client gets), PyTorch with its default threads. Prints the figures and writes
OUT/arch_steps_<backend>.json/.csv.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from fedjax_het.kernels import onednn
from fedjax_het.models.forward import forward
from fedjax_het.models.registry import build_model
from fedjax_het.run.cli import app_run

from harness import RESULTS, best_seconds, sgd_step_fn, write_results

flags.DEFINE_list('archs', ['mobilenet_v2', 'resnet152', 'vit_b16'], 'Architectures (models.registry names).')
flags.DEFINE_list('conv', ['onednn'], 'fedjax_het\'s convolution formulations (ExecutionConfig.conv values).')
flags.DEFINE_integer('batch_size', 32, 'Rows of a training step (FedRE Table 1\'s batch).')
flags.DEFINE_integer('rows', 33, 'Rows of a representation pass.')
flags.DEFINE_integer('repeats', 5, 'Timed calls per figure (the fastest is kept).')
flags.DEFINE_boolean('torch', True, 'Time PyTorch\'s side too (needs torch).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


def fedjax_side(arch: str, conv: str, x, y, rows) -> dict:
  """{'step_ms', 'represent_ms'} of fedjax_het's classifier `arch` with convolutions `conv`."""
  model = build_model(arch, 10, conv=conv)
  variables = model.init(jax.random.PRNGKey(0), x[:2])
  params = variables.pop('params')
  step, carry = sgd_step_fn(model, params, model_state=dict(variables))
  step = jax.jit(step)
  represent = jax.jit(lambda p, s, xb: forward(model, p, s, xb, False)[1])
  return {'step_ms': 1e3 * best_seconds(lambda: step(carry, x, y)[1], FLAGS.repeats),
          'represent_ms': 1e3 * best_seconds(lambda: represent(params, dict(variables), rows), FLAGS.repeats)}


def torch_side(arch: str, x, y, rows) -> dict:
  """The same figures of PyTorch's model of `arch`."""
  import torch
  from torch_reference import torch_model
  model = torch_model(arch)
  optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
  x, y, rows = (torch.from_numpy(np.asarray(a)) for a in (x.transpose(0, 3, 1, 2), y, rows.transpose(0, 3, 1, 2)))
  y = y.long()

  def step():
    model.train()
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()

  def represent():
    model.eval()
    with torch.no_grad():
      model.represent(rows)
  return {'torch_threads': torch.get_num_threads(), 'torch_step_ms': 1e3 * best_seconds(step, FLAGS.repeats),
          'torch_represent_ms': 1e3 * best_seconds(represent, FLAGS.repeats)}


def main(_):
  if jax.default_backend() == 'cpu' and onednn.unavailable_reason() is None:
    onednn.set_threads(0)  # every core per convolution
  rng = np.random.default_rng(0)
  x = rng.standard_normal((FLAGS.batch_size, 32, 32, 3)).astype(np.float32)
  y = rng.integers(0, 10, FLAGS.batch_size).astype(np.int32)
  rows = rng.standard_normal((FLAGS.rows, 32, 32, 3)).astype(np.float32)
  settings = {k: FLAGS[k].value for k in ('archs', 'conv', 'batch_size', 'rows', 'repeats')}
  # PyTorch's side first, before any of fedjax_het's convolutions has run: oneDNN's OpenMP threads (another
  # OpenMP runtime than PyTorch's) would otherwise share the cores with PyTorch's.
  torch_rows = {arch: torch_side(arch, x, y, rows) if FLAGS.torch else {} for arch in FLAGS.archs}
  out = []
  for arch in FLAGS.archs:
    row = {'arch': arch}
    for conv in FLAGS.conv:
      figures = fedjax_side(arch, conv, jnp.asarray(x), jnp.asarray(y), jnp.asarray(rows))
      row.update({f'{conv}_{k}': v for k, v in figures.items()})
    row.update(torch_rows[arch])
    out.append(row)
    print(arch, ', '.join(f'{k} {v:.1f}' for k, v in row.items() if k.endswith('_ms')), flush=True)
    write_results(FLAGS.out, f'arch_steps_{jax.default_backend()}', settings, out, complete=False)
  write_results(FLAGS.out, f'arch_steps_{jax.default_backend()}', settings, out)


if __name__ == '__main__':
  app_run(main)
