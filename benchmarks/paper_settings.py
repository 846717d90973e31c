"""The seed papers' own settings, timed: fedjax_het's FedRE round against the HtFLlib-style PyTorch loop.

  python benchmarks/paper_settings.py                                   # every setting at the tables' sizes
  python benchmarks/paper_settings.py --steps_per_client=1 --rounds=2   # a few minutes on a 2-core CPU

Settings (synthetic CIFAR-shaped data, 32x32x3, 10 classes, `harness.cifar_like`, IID equal splits of the tables'
client sizes; the FedRE round with its RAP upload and server step on every setting, since the PyTorch reference
is FedRE's round: what differs between the settings is the models, the clients, the batch and the step counts):
  fedre_table1     FedRE Table 1: 10 clients, one per architecture of --models=fedre-10 (cnn4, mobilenet_v2,
                   googlenet, resnet18/34/50/101/152, vit_b16, vit_b32), batch 32, 1 local epoch of 4,500 rows
                   (140 steps; CIFAR-10's 60,000 rows pooled, 75 % of each client's train)
  fedre_table1_20  the same at 20 clients, 2 per architecture (2,250 rows, 70 steps)
  gefl_table2      GeFL Table II's clients: 10 clients of GeFL's ten CIFAR-10 CNNs (--models=gefl-cifar10-10),
                   batch 128, 5 local epochs of 2,500 rows (GeFL's half of CIFAR-10; 95 steps)
  felo_table2      Felo Table 2's clients: 20 ResNet-18 clients, 20 % of them (4) per round, batch 50, 10 local
                   steps (--local_steps=10) on 2,500 rows each
With one client per architecture (fedre_table1, gefl_table2) vmap has nothing to batch: a round's speed is each
architecture's compiled local epoch, the compile time of the architectures and whether groups overlap.

Per setting, three fresh processes:
  cold   fedjax_het: `Federation.init` and the first round with XLA's persistent compilation cache in an empty
         temporary folder (initialisation + compilation); peak device memory (GPU: JAX's memory_stats; CPU: the
         process's peak RSS, data included); then `--rounds` rounds of fedjax_het alone
  warm   the same with the cache the cold process filled; then the PyTorch loop's first round, `--warmup_rounds`
         untimed rounds of each side, alternating (on a CPU fedjax_het's second and third rounds were slower than its
         later ones, while the process's page faults and system time fell as the C heap grew to hold a round's
         buffers), and `--rounds` rounds
         alternating a PyTorch round and a fedjax_het round, each timed to completion (seconds per round,
         side by side: the same participants, local steps and samples, checked every round); then one more
         fedjax_het round with each group timed to completion (the per-architecture breakdown: a group is one
         architecture; their sum against the round says whether groups overlap)
  torch  the PyTorch loop alone: its models built and its first round (its time to first round, peak memory: CUDA's
         max_memory_allocated, or the process's peak RSS), in a process that compiles nothing
The PyTorch loop (benchmarks/torch_reference.py, `TorchFedRE`) is HtFLlib's: one client after another, each with a
fresh SGD and a shuffled drop_last DataLoader, an eval-mode representation pass over its rows, the server step on
the global head; its models are the same architectures (tests/test_torch_reference.py checks their parameter counts
and an SGD step's losses against fedjax_het's).

Reduced runs: --steps_per_client=N caps every client's local steps on both sides (`LocalTraining.max_steps`) and,
unless --samples_per_client is given, gives each client only the rows N steps need (smaller representation
passes); --archs keeps only those architectures (and each setting's clients of them); --settings and --rounds.

Writes OUT/paper_settings_<backend>.json/.csv (a row per setting) and OUT/paper_settings_archs_<backend>.json/.csv
(a row per setting and architecture), rewritten after every case, so that a run stopped at a time limit keeps the
cases it finished (a figure of a case not run is empty); each case's progress (initialisation, each group's first
round, the case's end) is printed on stderr as it comes. --cases runs some of the cases.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, write_results

FEDRE_10 = ('cnn4', 'mobilenet_v2', 'googlenet', 'resnet18', 'resnet34', 'resnet50', 'resnet101', 'resnet152',
            'vit_b16', 'vit_b32')
GEFL_CIFAR10_10 = tuple(f'gefl_cifar10_cnn{k}' for k in range(1, 11))


@dataclasses.dataclass(frozen=True)
class Setting:
  description: str
  models: tuple
  num_clients: int
  batch_size: int
  epochs: int
  samples_per_client: int  # pool rows per client, 75 % of them train (harness.cifar_like)
  learning_rate: float
  join_ratio: float = 1.0
  max_steps: Optional[int] = None  # the table's own step cap (Felo's --local_steps)


SETTINGS = {
    'fedre_table1': Setting('FedRE Table 1: 10 clients, one per architecture (fedre-10)', FEDRE_10, 10, 32, 1, 6000,
                            0.06),
    'fedre_table1_20': Setting('FedRE Table 1 at 20 clients, 2 per architecture', FEDRE_10, 20, 32, 1, 3000, 0.06),
    'gefl_table2': Setting("GeFL Table II's clients: GeFL's ten CIFAR-10 CNNs, one client each", GEFL_CIFAR10_10, 10,
                           128, 5, 3334, 0.1),
    'felo_table2': Setting("Felo Table 2's clients: 20 ResNet-18 clients, 4 per round, 10 steps of 50", ('resnet18',),
                           20, 50, 1, 3334, 0.01, join_ratio=0.2, max_steps=10),
}

flags.DEFINE_list('settings', list(SETTINGS), f'Settings to time, in order: {", ".join(SETTINGS)}.')
flags.DEFINE_list('archs', None, 'Keep only these architectures (and the clients of them) in every setting; a setting '
                  'left without one is skipped. Default: every architecture of each setting.')
flags.DEFINE_integer('steps_per_client', None, 'At most this many local SGD steps per client and round, both sides '
                     '(default: the tables\' epochs).')
flags.DEFINE_integer('samples_per_client', None, 'Pool rows per client, 75 % of them train (default: the table\'s, or '
                     'with --steps_per_client the rows those steps need).')
flags.DEFINE_integer('rounds', 3, 'Timed rounds per side, alternating, after each side\'s first round and '
                     '--warmup_rounds.')
flags.DEFINE_integer('warmup_rounds', 2, 'Untimed rounds per side, alternating, between each side\'s first round and '
                     'the timed ones (module docstring).')
flags.DEFINE_integer('torch_eval_batch_size', 144, 'Rows per PyTorch representation pass (as vs_pytorch.py).')
flags.DEFINE_enum('strategy', None, ['vmap', 'sequential'], 'fedjax_het\'s executor (default: the backend\'s, '
                  'ExecutionConfig.strategy).')
flags.DEFINE_string('conv', None, 'fedjax_het\'s convolutions in every group (default: the backend\'s, '
                    'ExecutionConfig.conv).')
flags.DEFINE_boolean('scan_blocks', False, 'fedjax_het scans its models\' runs of identical blocks '
                     '(`ExecutionConfig.scan_blocks`: ResNet stages, ViT encoders; less to compile).')
flags.DEFINE_list('cases', ['cold', 'warm', 'torch'], 'The cases to run per setting, of cold, warm and torch (module '
                  'docstring); warm reads the cache cold fills, so warm alone times a start whose cache is empty.')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
flags.DEFINE_string('child', None, 'Internal: run one case (JSON) in this process and print its results.')
FLAGS = flags.FLAGS


def resolve(name: str) -> Optional[dict]:
  """The setting as one process runs it (after --archs, --steps_per_client, --samples_per_client), or None where
  --archs leaves it no architecture."""
  s = SETTINGS[name]
  models = [m for m in s.models if FLAGS.archs is None or m in FLAGS.archs]
  if not models:
    return None
  per_arch = s.num_clients // len(s.models)  # clients per architecture (Felo: all 20 on one)
  max_steps = s.max_steps
  if FLAGS.steps_per_client is not None:
    max_steps = min(max_steps or FLAGS.steps_per_client, FLAGS.steps_per_client)
  samples = FLAGS.samples_per_client
  if samples is None:
    samples = s.samples_per_client
    if FLAGS.steps_per_client is not None:  # the rows those steps need (train = 75 % of a client's rows)
      samples = min(samples, math.ceil(max_steps * s.batch_size / 0.75) + 2)
  return {'setting': name, 'description': s.description, 'models': models, 'num_clients': per_arch * len(models),
          'batch_size': s.batch_size, 'epochs': s.epochs, 'max_steps': max_steps, 'samples_per_client': samples,
          'learning_rate': s.learning_rate, 'join_ratio': s.join_ratio}


# ---------------------------------------------------------------- one case, in its own process

def peak_memory_mib() -> dict:
  """JAX's peak device memory where the device reports it (GPU), and the process's peak RSS, in MiB."""
  import jax
  out = {'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
  stats = jax.local_devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    out['peak_device_mib'] = stats['peak_bytes_in_use'] / 2**20
  return out


def note(message: str) -> None:
  """A progress line on stderr (a case's process: the parent shows it as it comes)."""
  print(message, file=sys.stderr, flush=True)


def per_group_timer(fed, record: dict, case: str = ''):
  """Wraps the federation's executor so that each group's part of a round is timed to completion into
  record[arch] (seconds), each noted as it ends where `case` names one; returns the function that unwraps it."""
  import jax
  original = fed.executor.run

  def run(g, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(original(g, *args))
    record[g.arch] = record.get(g.arch, 0.0) + time.perf_counter() - t0
    if case:
      note(f'  {case}: group {g.arch} done in {time.perf_counter() - t0:.1f} s')
    return out
  fed.executor.run = run
  return lambda: delattr(fed.executor, 'run')


def torch_side(spec: dict, data, device: str):
  """(TorchFedRE over the setting's clients, each with its architecture's PyTorch model, seconds to build it)."""
  import numpy as np
  import torch
  from torch_reference import TorchFedRE, torch_model
  t0 = time.perf_counter()
  tensors, models = [], []
  for k in range(data.num_clients):
    rows = data.split.train_indices[k]
    x = np.ascontiguousarray(np.asarray(data.dataset.x[rows]).transpose(0, 3, 1, 2))
    tensors.append((torch.from_numpy(x).to(device), torch.from_numpy(data.dataset.y[rows].astype(np.int64)).to(device)))
    models.append(torch_model(spec['models'][k % len(spec['models'])], 10, 512, x.shape[2:] + x.shape[1:2]))
  ref = TorchFedRE(tensors, 10, spec['learning_rate'], spec['batch_size'], epochs=spec['epochs'], device=device,
                   eval_batch_size=FLAGS.torch_eval_batch_size, init_models=models, max_steps=spec['max_steps'])
  if device == 'cuda':
    torch.cuda.synchronize()
  return ref, time.perf_counter() - t0


def by_arch(spec: dict, client_seconds: dict) -> dict:
  """{arch: seconds} summed over the clients of each architecture."""
  out = {}
  for k, seconds in client_seconds.items():
    arch = spec['models'][k % len(spec['models'])]
    out[arch] = out.get(arch, 0.0) + seconds
  return out


def run_case(spec: dict, case: str, cache: str, device: Optional[str]) -> dict:
  """One case ('cold', 'warm' or 'torch', module docstring) of a resolved setting; `device`: PyTorch's (the torch
  case, which leaves JAX's backend alone; the others take 'cuda' where JAX runs on a GPU)."""
  import numpy as np
  import torch
  from harness import cifar_like

  if device is None:
    import jax
    device = 'cuda' if torch.cuda.is_available() and jax.default_backend() == 'gpu' else 'cpu'
  if device == 'cuda':  # the same arithmetic on both sides (vs_pytorch.py): XLA's float32 matmuls and convolutions
    torch.backends.cuda.matmul.allow_tf32 = True  # are TF32 on NVIDIA GPUs by default
    torch.backends.cudnn.allow_tf32 = True
  data = cifar_like(spec['num_clients'], spec['samples_per_client'])
  out = {'case': case, 'torch_device': device, 'torch_threads': torch.get_num_threads(),
         'load_average_start': os.getloadavg()[0]}
  if case == 'torch':
    participants = sorted(np.random.default_rng(0).choice(
        data.num_clients, max(1, int(round(spec['join_ratio'] * data.num_clients))), replace=False).tolist())
    ref, build = torch_side(spec, data, device)
    t0 = time.perf_counter()
    ref.round(participants)
    first = time.perf_counter() - t0
    out.update(torch_build_seconds=build, torch_first_round_seconds=first, torch_to_first_round_seconds=build + first,
               torch_first_round_by_arch=by_arch(spec, ref.client_seconds),
               peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if device == 'cuda':
      out['torch_peak_device_mib'] = torch.cuda.max_memory_allocated() / 2**20
    return out

  import jax
  from harness import CompileLog
  from fedjax_het.engine import ExecutionConfig, Federation, LocalTraining
  from fedjax_het.methods import FedREConfig, fedre
  from fedjax_het.run.compilation_cache import use_compilation_cache
  use_compilation_cache(cache)
  out['backend'] = jax.default_backend()
  training = LocalTraining(spec['learning_rate'], spec['batch_size'], spec['epochs'], max_steps=spec['max_steps'])
  execution = ExecutionConfig(strategy=FLAGS.strategy, conv=FLAGS.conv, scan_blocks=FLAGS.scan_blocks)
  # rounds: the rounds run (a run of 0 rounds would take every client in every round: join_ratio applies within
  # the run's length)
  fed = Federation(fedre(FedREConfig(), 10), data, list(spec['models']), training, execution,
                   join_ratio=spec['join_ratio'], rounds=FLAGS.rounds + FLAGS.warmup_rounds + 2)
  out.update(strategy=fed.strategy, conv='/'.join(dict.fromkeys(g.spec.conv for g in fed.groups)))
  with CompileLog() as log:
    t0 = time.perf_counter()
    state = jax.block_until_ready(fed.init())
    out.update(init_seconds=time.perf_counter() - t0, init_compilations=len(log.durations),
               init_compile_seconds=sum(log.durations))
  note(f'  {case}: initialised in {out["init_seconds"]:.1f} s ({len(log.durations)} compilations)')
  groups: dict = {}
  unwrap = per_group_timer(fed, groups, case)
  with CompileLog() as log:
    participants = fed.participants(int(state.round)).tolist()
    t0 = time.perf_counter()
    state, m = fed.round(state)
    out.update(first_round_seconds=time.perf_counter() - t0, first_round_compilations=len(log.durations),
               first_round_compile_seconds=sum(log.durations), first_round_by_arch=dict(groups),
               local_steps=m['local_steps'], local_samples=m['local_samples'], participants=len(participants))
  unwrap()
  out['to_first_round_seconds'] = out['init_seconds'] + out['first_round_seconds']
  if case == 'cold':  # then --rounds rounds of fedjax_het alone (the round, compiled, without the PyTorch loop)
    out.update(peak_memory_mib())
    rounds = []
    for _ in range(FLAGS.rounds):
      state, m = fed.round(state)
      rounds.append(m['train_seconds'])
    out['rounds_seconds'] = float(np.mean(rounds)) if rounds else None
    note(f'  {case}: {FLAGS.rounds} more rounds, {out["rounds_seconds"] or 0:.3f} s each')
    return out

  # warm: the PyTorch loop's first round, then the two sides alternating, then one fedjax_het round timed by group
  ref, build = torch_side(spec, data, device)
  t0 = time.perf_counter()
  ref.round(fed.participants(0).tolist())
  out.update(torch_build_seconds=build, torch_first_round_seconds=time.perf_counter() - t0)
  for _ in range(FLAGS.warmup_rounds):
    ref.round(fed.participants(int(state.round)).tolist())
    state, _ = fed.round(state)
  times = {'torch': [], 'fedjax': []}
  torch_arch: dict = {}
  with CompileLog() as log:
    for _ in range(FLAGS.rounds):
      participants = fed.participants(int(state.round)).tolist()
      before = ref.steps, ref.samples
      t0 = time.perf_counter()
      ref.round(participants)
      times['torch'].append(time.perf_counter() - t0)
      for arch, seconds in by_arch(spec, ref.client_seconds).items():
        torch_arch[arch] = torch_arch.get(arch, 0.0) + seconds / FLAGS.rounds
      state, m = fed.round(state)
      times['fedjax'].append(m['train_seconds'])
      done = (ref.steps - before[0], ref.samples - before[1])
      assert done == (m['local_steps'], m['local_samples']), (done, m['local_steps'], m['local_samples'])
    later = len(log.durations)
  groups = {}
  unwrap = per_group_timer(fed, groups)
  t0 = time.perf_counter()
  state, m = fed.round(state)
  instrumented = time.perf_counter() - t0
  unwrap()
  out.update(torch_rounds=times['torch'], fedjax_rounds=times['fedjax'],
             torch_round_seconds=float(np.mean(times['torch'])), fedjax_round_seconds=float(np.mean(times['fedjax'])),
             compilations_later_rounds=later, torch_round_by_arch=torch_arch, fedjax_round_by_arch=dict(groups),
             fedjax_timed_round_seconds=instrumented)
  return out


# ---------------------------------------------------------------- the parent: each case in a fresh process

def child(spec: dict, case: str, cache: str, device: Optional[str] = None) -> dict:
  """Runs one case in a fresh process (no compilation cache but `cache`; JAX allocating GPU memory as it needs
  it, XLA_PYTHON_CLIENT_PREALLOCATE=false, so that the PyTorch loop of the warm case has the rest) and returns its
  results; its progress lines pass through to stderr as they come."""
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  job = {'spec': spec, 'case': case, 'cache': cache, 'device': device}
  args = [sys.executable, os.path.abspath(__file__), '--child=' + json.dumps(job),
          f'--rounds={FLAGS.rounds}', f'--torch_eval_batch_size={FLAGS.torch_eval_batch_size}']
  args += [f'--{name}={FLAGS[name].value}' for name in ('strategy', 'conv') if FLAGS[name].value is not None]
  args += ['--scan_blocks'] if FLAGS.scan_blocks else []
  note(f'{spec["setting"]}: case {case}')
  t0 = time.perf_counter()
  done = subprocess.run(args, stdout=subprocess.PIPE, text=True, env=env)
  if done.returncode:
    raise RuntimeError(f'{spec["setting"]}, case {case} failed (exit {done.returncode}); its output is above')
  out = json.loads(done.stdout.strip().splitlines()[-1])
  note(f'{spec["setting"]}: case {case} done in {time.perf_counter() - t0:.1f} s')
  return out


def main(_):
  if FLAGS.child is not None:
    job = json.loads(FLAGS.child)
    print(json.dumps(run_case(job['spec'], job['case'], job['cache'], job['device'])))
    return
  # This process writes the results (harness.machine() starts JAX's backend): on a GPU it must not take the memory
  # its children need.
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  if not FLAGS.cases or set(FLAGS.cases) - {'cold', 'warm', 'torch'}:
    sys.exit(f'error: --cases={",".join(FLAGS.cases)}: choose one or more of cold, warm and torch. Fix: e.g. '
             f'--cases=cold.')
  unknown = [s for s in FLAGS.settings if s not in SETTINGS]
  if unknown:
    sys.exit(f'error: --settings: unknown {", ".join(unknown)}. Fix: choose from {", ".join(SETTINGS)}.')
  rows, arch_rows = [], []
  settings = {'rounds': FLAGS.rounds, 'steps_per_client': FLAGS.steps_per_client, 'archs': FLAGS.archs,
              'strategy': FLAGS.strategy, 'conv': FLAGS.conv, 'scan_blocks': FLAGS.scan_blocks,
              'cases': ','.join(FLAGS.cases), 'samples_per_client': FLAGS.samples_per_client,
              'torch_eval_batch_size': FLAGS.torch_eval_batch_size}
  import jax
  backend = jax.default_backend()  # the cases' too: they run on this machine

  def write(complete: bool) -> None:  # every results file rewritten
    write_results(FLAGS.out, f'paper_settings_{backend}', settings, rows, complete=complete)
    write_results(FLAGS.out, f'paper_settings_archs_{backend}', settings, [a for per in arch_rows for a in per],
                  complete=complete)

  for name in FLAGS.settings:
    spec = resolve(name)
    if spec is None:
      print(f'{name}: skipped, none of its architectures is in --archs', flush=True)
      continue
    cases: dict = {}
    rows.append(None)
    arch_rows.append([])

    def run(case: str, cache: str, device: Optional[str] = None) -> None:  # the setting's row after each case
      cases[case] = child(spec, case, cache, device)
      rows[-1], arch_rows[-1] = setting_row(name, spec, cases), setting_arch_rows(name, spec, cases)
      write(complete=False)
    with tempfile.TemporaryDirectory(prefix='paper_settings_xla_') as cache:
      for case in ('cold', 'warm'):
        if case in FLAGS.cases:
          run(case, cache)
    if 'torch' in FLAGS.cases:
      run('torch', '', next((c['torch_device'] for c in cases.values()), None))
    print_setting(spec, rows[-1], arch_rows[-1])
  if rows:
    write(complete=True)


def setting_row(name: str, spec: dict, cases: dict) -> dict:
  """A setting's row from its cases run so far ('cold', 'warm', 'torch'); a figure of a case not run is None."""
  cold, warm, alone = (cases.get(c, {}) for c in ('cold', 'warm', 'torch'))
  plus = lambda a, b: None if a is None or b is None else a + b
  some = warm or cold
  row = {'setting': name, 'description': spec['description'], 'architectures': len(spec['models']),
         'num_clients': spec['num_clients'], 'participants': some.get('participants'),
         'batch_size': spec['batch_size'], 'samples_per_client': spec['samples_per_client'],
         'local_steps': some.get('local_steps'), 'local_samples': some.get('local_samples'),
         'strategy': some.get('strategy'), 'conv': some.get('conv'),
         'torch_device': (warm or alone).get('torch_device'),
         'cold_init_seconds': cold.get('init_seconds'), 'cold_first_round_seconds': cold.get('first_round_seconds'),
         'cold_to_first_round_seconds': cold.get('to_first_round_seconds'),
         'cold_compilations': plus(cold.get('init_compilations'), cold.get('first_round_compilations')),
         'cold_compile_seconds': plus(cold.get('init_compile_seconds'), cold.get('first_round_compile_seconds')),
         'cold_round_seconds': cold.get('rounds_seconds'),
         'warm_init_seconds': warm.get('init_seconds'), 'warm_first_round_seconds': warm.get('first_round_seconds'),
         'warm_to_first_round_seconds': warm.get('to_first_round_seconds'),
         'warm_compile_seconds': plus(warm.get('init_compile_seconds'), warm.get('first_round_compile_seconds')),
         'torch_to_first_round_seconds': alone.get('torch_to_first_round_seconds'),
         'torch_first_round_seconds': alone.get('torch_first_round_seconds'),
         'fedjax_round_seconds': warm.get('fedjax_round_seconds'), 'torch_round_seconds': warm.get('torch_round_seconds'),
         'speedup_vs_torch': (warm['torch_round_seconds'] / warm['fedjax_round_seconds']
                              if 'fedjax_round_seconds' in warm else None),
         'fedjax_rounds': warm.get('fedjax_rounds'), 'torch_rounds': warm.get('torch_rounds'),
         'warmup_rounds': FLAGS.warmup_rounds,
         'compilations_later_rounds': warm.get('compilations_later_rounds'),
         'fedjax_timed_round_seconds': warm.get('fedjax_timed_round_seconds'),
         'fedjax_groups_sum_seconds': (sum(warm['fedjax_round_by_arch'].values())
                                       if 'fedjax_round_by_arch' in warm else None),
         'fedjax_peak_device_mib': cold.get('peak_device_mib'),
         'torch_peak_device_mib': alone.get('torch_peak_device_mib'),
         'fedjax_peak_rss_mib': cold.get('peak_rss_mib'), 'torch_peak_rss_mib': alone.get('peak_rss_mib'),
         # the machine's 1-minute load average as each case started: other processes on the cores (a shared CPU)
         'load_average': [c.get('load_average_start') for c in (cold, warm, alone)],
         'torch_threads': (warm or alone).get('torch_threads')}
  return row


def setting_arch_rows(name: str, spec: dict, cases: dict) -> list:
  """A setting's rows per architecture from its cases run so far."""
  cold, warm, alone = (cases.get(c, {}) for c in ('cold', 'warm', 'torch'))
  return [{'setting': name, 'arch': arch, 'clients': spec['num_clients'] // len(spec['models']),
           'fedjax_first_round_cold_seconds': cold.get('first_round_by_arch', {}).get(arch),
           'fedjax_first_round_warm_seconds': warm.get('first_round_by_arch', {}).get(arch),
           'torch_first_round_seconds': alone.get('torch_first_round_by_arch', {}).get(arch),
           'fedjax_round_seconds': warm.get('fedjax_round_by_arch', {}).get(arch),
           'torch_round_seconds': warm.get('torch_round_by_arch', {}).get(arch)} for arch in spec['models']]


def print_setting(spec: dict, row: dict, arch_rows: list) -> None:
  """The setting's figures on stdout ('-' for a case not run)."""
  fmt = lambda v, f='.3f': '-' if v is None else format(v, f)
  print(f'{row["setting"]}: {spec["num_clients"]} clients, {len(spec["models"])} architectures, '
        f'{fmt(row["local_steps"], "")} steps per round; to first round: fedjax_het cold '
        f'{fmt(row["cold_to_first_round_seconds"], ".1f")} s, warm {fmt(row["warm_to_first_round_seconds"], ".1f")} s, '
        f'PyTorch {fmt(row["torch_to_first_round_seconds"], ".1f")} s; per round: fedjax_het '
        f'{fmt(row["fedjax_round_seconds"])} s, PyTorch {fmt(row["torch_round_seconds"])} s '
        f'({fmt(row["speedup_vs_torch"], ".2f")}x)', flush=True)
  for a in arch_rows:
    print(f'  {a["arch"]:>20}: first round cold / warm {fmt(a["fedjax_first_round_cold_seconds"])} / '
          f'{fmt(a["fedjax_first_round_warm_seconds"])} s, PyTorch {fmt(a["torch_first_round_seconds"])} s; '
          f'round fedjax_het {fmt(a["fedjax_round_seconds"])} s, PyTorch {fmt(a["torch_round_seconds"])} s',
          flush=True)


if __name__ == '__main__':
  app_run(main)
