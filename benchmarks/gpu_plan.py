"""What a round should cost on an H100, from XLA's own analyses of the compiled pieces of the round.

  python benchmarks/gpu_plan.py                       # every setting below
  python benchmarks/gpu_plan.py --settings=quickstart --out=/tmp/plan

For each setting a Federation is built under the vmap executor with XLA's convolutions and 256-row eval-mode
passes (the GPU defaults) on synthetic data of the setting's shapes and sizes (IID equal splits; the models exist
only as shapes, never allocated). Per architecture group, the function of one local step vmapped over the group's K
clients and over one client is lowered and analysed (`Lowered.cost_analysis()`: XLA's HLO cost analysis, FLOPs and
the bytes its unfused operations access), and the one-client step compiled for this machine's backend
(`Compiled.memory_analysis()`: its temporaries). XLA counts a loop's body once, so a round is assembled from
loop-free pieces: steps per round (the engine's plan of each stage) x the step, plus, for methods that upload
representations, the eval-mode passes over the training rows (one pass analysed, times the passes). The server step
and the clients' prepare/final are not counted (FedRE's server trains one linear head). GeFL's DDPM row is the
sampling of one synthetic epoch: T reverse steps of the U-Net (analysed with T = 1) per batch of generated images,
at the paper's CIFAR-10 size.

Bounds, per round (all clients of the group):
  roofline = max(FLOPs / peak, bytes / bandwidth), bytes = what a step must move at least: its arguments (the
    client's parameters, optimizer state, batch) read and its results written once (the unfused HLO's bytes, which
    count every operation's operands and result, are reported beside it as an upper estimate); the same for a
    vmapped round and a loop: the same work;
  launches: a loop launches every kernel of a step once per client and step, a vmapped round once per step;
    kernels per step >= its convolutions and dot products (each at least one cuDNN/cuBLAS call), counted in the
    lowered step; each launch costs at least --launch_seconds;
  loop bound = K x steps x max(step roofline of one client, kernels x launch); vmap bound = steps x max(step
    roofline of K clients, kernels x launch).
Memory per client: its state (parameters, BatchNorm statistics, per-client method state), its optimizer state in
the step's carry, its training rows, and the one-client step's temporaries on this backend (a GPU's differ); clients
that fit = floor(--memory_gb / that).

H100 figures (NVIDIA's H100 SXM5 datasheet): TF32 tensor-core peak 494.7 TFLOP/s dense (XLA computes float32
convolutions and matmuls in TF32 on Hopper by default), HBM3 bandwidth 3.35 TB/s, 80 GB. Prints a table and writes
benchmarks/results/gpu_plan_<backend>.json and .csv (rewritten after every setting).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, write_results

from fedjax_het.core import Batch
from fedjax_het.data import make_federated_data, make_synthetic
from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining, ModelConfig
from fedjax_het.engine.plan import plan_stages
from fedjax_het.methods import FedREConfig, GeFLConfig, fedavg_grouped, fedre
from fedjax_het.methods.gefl import build_generator
from fedjax_het.models.forward import forward

flags.DEFINE_list('settings', ['quickstart', 'fedre_table1', 'fedre_table1_20', 'fedavg_resnet18', 'gefl_ddpm'],
                  'Settings to analyse (see SETTINGS).')
flags.DEFINE_float('peak_flops', 494.7e12, 'Peak FLOP/s of the target (H100 SXM5 TF32 dense).')
flags.DEFINE_float('bandwidth', 3.35e12, 'Memory bandwidth of the target, bytes/s (H100 SXM5 HBM3).')
flags.DEFINE_float('memory_gb', 80.0, 'Device memory of the target, GB (1e9 bytes).')
flags.DEFINE_float('launch_seconds', 3e-6, 'Least time of one kernel launch (an assumption: CUDA launches take a '
                   'few microseconds).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


@dataclasses.dataclass(frozen=True)
class Setting:
  """One analysed setting: its data (rows, image shape, classes, clients), models, method and local schedule."""
  description: str
  rows: int
  image: tuple
  num_classes: int
  num_clients: int
  models: tuple
  algorithm: Callable[[], Any]
  batch_size: int
  epochs: int = 1
  feature_dim: int = 512
  rm: str = 'ap'
  train_fraction: float = 0.75


SETTINGS = {
    'quickstart': Setting('README quickstart (digits 8x8, FedRE, 3 CNNs)', 1797, (8, 8, 1), 10, 10,
                          ('small_cnn', 'mlp', 'small_cnn_narrow'), lambda: fedre(FedREConfig(), 10), 32),
    'fedre_table1': Setting('FedRE Table 1 CIFAR-10 (10 clients, the 10 architectures)', 60000, (32, 32, 3), 10, 10,
                            ('cnn4', 'mobilenet_v2', 'googlenet', 'resnet18', 'resnet34', 'resnet50', 'resnet101',
                             'resnet152', 'vit_b16', 'vit_b32'), lambda: fedre(FedREConfig(), 10), 32),
    'fedre_table1_20': Setting('FedRE CIFAR-10 at 20 clients (2 per architecture)', 60000, (32, 32, 3), 10, 20,
                               ('cnn4', 'mobilenet_v2', 'googlenet', 'resnet18', 'resnet34', 'resnet50',
                                'resnet101', 'resnet152', 'vit_b16', 'vit_b32'), lambda: fedre(FedREConfig(), 10), 32),
    'fedavg_resnet18': Setting('grouped FedAvg, ResNet-18, CIFAR-10, 20 clients', 60000, (32, 32, 3), 10, 20,
                               ('resnet18',), lambda: fedavg_grouped(10), 32),
}
GEFL_DDPM = dict(description="GeFL's DDPM sampling (CIFAR-10 U-Net n = 128, T = 400; one synthetic epoch of a "
                             "client of 2,500 rows: 19 batches of 128)", rows=2500, batch=128, steps=400, width=128)


def tree_bytes(tree) -> int:
  return int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def analyse(fn: Callable, *args, compile_memory: bool = False) -> dict:
  """XLA's cost analysis of fn lowered at args: FLOPs and the bytes its unfused HLO accesses (every operation
  reading its operands from memory and writing its result: more than fused kernels move); 'bytes', what any
  implementation moves at least: its arguments read and its results written once; its convolutions and dot
  products; with compile_memory its compiled temporaries on this backend."""
  lowered = jax.jit(fn).lower(*args)
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  text = lowered.as_text()
  moved = sum(tree_bytes(a) for a in args)
  out_shapes = jax.eval_shape(fn, *args)
  out = {'flops': float(cost.get('flops', 0.0)), 'bytes': float(moved + tree_bytes(out_shapes)),
         'unfused_bytes': float(cost.get('bytes accessed', 0.0)),
         'kernels': text.count('stablehlo.convolution') + text.count('stablehlo.dot_general'),
         'loops': text.count('stablehlo.while')}
  if compile_memory:
    memory = lowered.compile().memory_analysis()
    out['temp_bytes'] = int(getattr(memory, 'temp_size_in_bytes', 0)) if memory is not None else 0
  return out


def bounds(k: int, steps: int, one: dict, all_k: dict) -> dict:
  """Roofline and launch bounds of a round (module docstring)."""
  roof = lambda c: max(c['flops'] / FLAGS.peak_flops, c['bytes'] / FLAGS.bandwidth)
  launch = one['kernels'] * FLAGS.launch_seconds
  return {'roofline_seconds': steps * roof(all_k), 'loop_bound_seconds': k * steps * max(roof(one), launch),
          'vmap_bound_seconds': steps * max(roof(all_k), launch)}


def group_rows(setting: Setting) -> list[dict]:
  """One row per architecture group of a training setting."""
  ds = make_synthetic(num_samples=round(setting.rows * 0.8), image_shape=setting.image,  # 20 % more as its test
                      num_classes=setting.num_classes, seed=0)                           # split: `rows` pooled
  data = make_federated_data(ds, setting.num_clients, 'iid', seed=0, train_fraction=setting.train_fraction)
  fed = Federation(setting.algorithm(), data, ModelConfig(setting.models, setting.feature_dim, setting.rm),
                   LocalTraining(0.01, setting.batch_size, setting.epochs),
                   ExecutionConfig(strategy='vmap', conv='xla', eval_batch_size=256))
  server = fed.server_shapes()
  key = jax.random.PRNGKey(0)
  rows = []
  for gi, g in enumerate(fed.groups):
    t0 = time.perf_counter()
    program = fed.programs[0][gi]
    stacked = jax.eval_shape(lambda gi=gi: fed.init_group(gi))
    k = g.size
    one_client = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
    broadcast = jax.eval_shape(lambda s, gi=gi: fed.broadcast(s, gi, 0), server)
    n_max = int(g.train.x.shape[1])
    carry = jax.eval_shape(program.init, one_client, broadcast, key)
    x, y = g.train.x, g.train.y
    steps, flops, nbytes, one_flops, one_bytes, kernels, temp = 0, 0.0, 0.0, 0.0, 0.0, 0, 0
    loops, unfused = 0, 0.0
    for plan in plan_stages(program, n_max):
      if not plan.length:
        continue
      b = plan.training.batch_size
      batch = Batch(jax.ShapeDtypeStruct((b,) + x.shape[2:], x.dtype), jax.ShapeDtypeStruct((b,), y.dtype),
                    jax.ShapeDtypeStruct((b,), jnp.int32), None)
      step = plan.stage.step
      single = analyse(lambda c, bt, br, kk: step(c, bt, br, kk), carry, batch, broadcast, key, compile_memory=True)
      stacked_carry = jax.tree.map(lambda a: jax.ShapeDtypeStruct((k,) + a.shape, a.dtype), carry)
      stacked_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((k,) + a.shape, a.dtype), batch)
      vmapped = analyse(jax.vmap(lambda c, bt, br, kk: step(c, bt, br, kk), in_axes=(0, 0, None, None)),
                        stacked_carry, stacked_batch, broadcast, key)
      steps += plan.length
      flops, nbytes = flops + plan.length * vmapped['flops'], nbytes + plan.length * vmapped['bytes']
      unfused += plan.length * vmapped['unfused_bytes']
      one_flops, one_bytes = one_flops + plan.length * single['flops'], one_bytes + plan.length * single['bytes']
      kernels, temp, loops = max(kernels, single['kernels']), max(temp, single['temp_bytes']), loops + single['loops']
    if program.trained is not None:  # the eval-mode representation passes over every training row
      chunk = min(n_max, fed.executor.eval_batch_size)
      passes = -(-n_max // chunk)
      rep = analyse(lambda p, s, xs: forward(g.model, p, s, xs, False)[1], one_client.params,
                    one_client.model_state, jax.ShapeDtypeStruct((chunk,) + x.shape[2:], x.dtype))
      flops, nbytes = flops + k * passes * rep['flops'], nbytes + k * passes * rep['bytes']
      unfused += k * passes * rep['unfused_bytes']
      one_flops, one_bytes = one_flops + passes * rep['flops'], one_bytes + passes * rep['bytes']
    per_step_one = {'flops': one_flops / steps, 'bytes': one_bytes / steps, 'kernels': kernels}
    per_step_k = {'flops': flops / steps, 'bytes': nbytes / steps, 'kernels': kernels}
    client_bytes = (tree_bytes(one_client) + tree_bytes(carry) - tree_bytes(one_client.params)
                    - tree_bytes(one_client.model_state) + n_max * (math.prod(x.shape[2:]) * 4 + 4) + temp)
    rows.append({'group': g.arch, 'clients': k, 'train_rows_per_client': n_max, 'steps_per_client': steps,
                 'gflop_per_round': flops / 1e9, 'gb_moved_per_round': nbytes / 1e9,
                 'gb_unfused_hlo_per_round': unfused / 1e9, 'kernels_per_step': kernels, 'loops_inside_step': loops,
                 **bounds(k, steps, per_step_one, per_step_k),
                 'bytes_per_client': client_bytes, 'clients_fit': int(FLAGS.memory_gb * 1e9 // client_bytes),
                 'analysis_seconds': time.perf_counter() - t0})
    print(f'  {g.arch}: {rows[-1]["gflop_per_round"]:.1f} GFLOP, {rows[-1]["gb_moved_per_round"]:.2f} GB, '
          f'{kernels} kernels/step', flush=True)
  return rows


def ddpm_rows() -> list[dict]:
  """GeFL's DDPM sampling of one synthetic epoch of one client (see GEFL_DDPM)."""
  spec = GEFL_DDPM
  gen = build_generator(GeFLConfig(generator='ddpm', diffusion_steps=1, width=spec['width']), 10, (32, 32, 3))
  variables = jax.eval_shape(gen.init, jax.random.PRNGKey(0))
  labels = jax.ShapeDtypeStruct((spec['batch'],), jnp.int32)
  step = analyse(gen.sample, variables, labels, jax.random.PRNGKey(0), compile_memory=True)
  batches = max(1, spec['rows'] // spec['batch'])
  steps = batches * spec['steps']  # reverse steps of the U-Net per client and epoch
  one = {'flops': step['flops'], 'bytes': step['bytes'], 'kernels': step['kernels']}
  k = 10
  return [{'group': 'ddpm_unet_n128', 'clients': k, 'train_rows_per_client': spec['rows'], 'steps_per_client': steps,
           'gflop_per_round': k * steps * step['flops'] / 1e9, 'gb_moved_per_round': k * steps * step['bytes'] / 1e9,
           'gb_unfused_hlo_per_round': k * steps * step['unfused_bytes'] / 1e9,
           'kernels_per_step': step['kernels'], 'loops_inside_step': step['loops'],
           **bounds(k, steps, one, {'flops': k * step['flops'], 'bytes': k * step['bytes'],
                                    'kernels': step['kernels']}),
           'bytes_per_client': tree_bytes(variables) + step['temp_bytes'],
           'clients_fit': int(FLAGS.memory_gb * 1e9 // (tree_bytes(variables) + step['temp_bytes'])),
           'analysis_seconds': 0.0}]


def main(argv):
  del argv
  rows = []
  settings = {'target': 'H100 SXM5', 'peak_flops': FLAGS.peak_flops, 'bandwidth': FLAGS.bandwidth,
              'memory_gb': FLAGS.memory_gb, 'launch_seconds': FLAGS.launch_seconds}
  for name in FLAGS.settings:
    if name not in SETTINGS and name != 'gefl_ddpm':
      raise app.UsageError(f'--settings: unknown {name!r}; choose from {", ".join(list(SETTINGS) + ["gefl_ddpm"])}.')
  for name in FLAGS.settings:
    description = GEFL_DDPM['description'] if name == 'gefl_ddpm' else SETTINGS[name].description
    print(f'{name}: {description}', flush=True)
    for row in (ddpm_rows() if name == 'gefl_ddpm' else group_rows(SETTINGS[name])):
      rows.append({'setting': name, **row})
    write_results(FLAGS.out, f'gpu_plan_{jax.default_backend()}', settings, rows, complete=False)
  header = (f'{"setting":>16} {"group":>14} {"K":>3} {"steps":>6} {"GFLOP":>10} {"GB":>9} {"roofline s":>10} '
            f'{"loop s":>8} {"vmap s":>8} {"fit 80GB":>8}')
  print(header)
  for r in rows:
    print(f'{r["setting"]:>16} {r["group"]:>14} {r["clients"]:>3} {r["steps_per_client"]:>6} '
          f'{r["gflop_per_round"]:>10.1f} {r["gb_moved_per_round"]:>9.2f} {r["roofline_seconds"]:>10.4f} '
          f'{r["loop_bound_seconds"]:>8.4f} {r["vmap_bound_seconds"]:>8.4f} {r["clients_fit"]:>8}')
  write_results(FLAGS.out, f'gpu_plan_{jax.default_backend()}', settings, rows)


if __name__ == '__main__':
  app_run(main)
