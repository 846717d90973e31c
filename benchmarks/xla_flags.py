"""XLA flags against a cold start and a round, per architecture, side by side.

  python benchmarks/xla_flags.py --archs=resnet152,vit_b16,resnet18 \
      --variants='default;--xla_gpu_enable_triton_gemm=false;--xla_gpu_autotune_level=0' --seconds=240

For each architecture and each variant of XLA_FLAGS (in that order, so that the variants of one architecture run
next to each other in time), `paper_settings.py --settings=fedre_table1 --archs=ARCH --cases=cold` in a fresh
process with that XLA_FLAGS (added to the environment's own) and an empty compilation cache: one FedRE client of
the architecture at FedRE Table 1's batch and rows, its initialisation, first round (compilation) and `--rounds`
more rounds. `default` is the environment's XLA_FLAGS alone; a variant's `--scan_blocks` is fedjax_het's
(`ExecutionConfig.scan_blocks`: the models' runs of identical blocks scanned), passed to paper_settings.py. A case
still running at --seconds is stopped and recorded as such; each row is written as it ends
(OUT/xla_flags_<backend>.json/.csv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS, write_results

flags.DEFINE_list('archs', ['resnet152', 'vit_b16', 'resnet18'], 'Architectures of FedRE Table 1, one client each.')
flags.DEFINE_string('variants', 'default;--scan_blocks;--xla_gpu_enable_triton_gemm=false;--xla_gpu_autotune_level=0',
                    'XLA_FLAGS variants separated by ";" (default: the environment\'s own); --scan_blocks in a variant '
                    'is fedjax_het\'s (ExecutionConfig.scan_blocks).')
flags.DEFINE_integer('steps_per_client', 20, 'Local steps per round (paper_settings.py --steps_per_client).')
flags.DEFINE_integer('rounds', 2, 'Rounds timed after the first.')
flags.DEFINE_integer('seconds', 0, 'Stop the case running at this many seconds from the start (0: no limit).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS

HERE = os.path.dirname(os.path.abspath(__file__))


FEDJAX_HET_WORDS = ('--scan_blocks',)  # a variant's words that are paper_settings.py's flags, not XLA's


def split_variant(variant: str) -> tuple[str, list[str]]:
  """A variant's XLA_FLAGS (the words XLA reads; '' for `default`) and its paper_settings.py flags."""
  words = [] if variant == 'default' else variant.split()
  return ' '.join(w for w in words if w not in FEDJAX_HET_WORDS), [w for w in words if w in FEDJAX_HET_WORDS]


def run_variant(arch: str, variant: str, limit) -> dict:
  """One cold case of `arch` under `variant` (a fresh paper_settings.py process); its row."""
  env = dict(os.environ)
  xla, ours = split_variant(variant)
  if xla:
    env['XLA_FLAGS'] = f'{env.get("XLA_FLAGS", "")} {xla}'.strip()
  row = {'arch': arch, 'xla_flags': variant}
  with tempfile.TemporaryDirectory(prefix='xla_flags_') as out:
    args = [sys.executable, os.path.join(HERE, 'paper_settings.py'), '--settings=fedre_table1', f'--archs={arch}',
            '--cases=cold', f'--steps_per_client={FLAGS.steps_per_client}', f'--rounds={FLAGS.rounds}',
            f'--out={out}'] + ours
    t0 = time.perf_counter()
    try:
      done = subprocess.run(args, env=env, stdout=subprocess.DEVNULL, timeout=limit)
    except subprocess.TimeoutExpired:
      row.update(stopped_at_seconds=time.perf_counter() - t0)
      return row
    results = [f for f in os.listdir(out) if f.startswith('paper_settings_') and 'archs' not in f
               and f.endswith('.json')]
    if done.returncode or not results:
      row.update(failed=f'exit {done.returncode}')
      return row
    with open(os.path.join(out, results[0])) as f:
      part = json.load(f)
  setting = part['rows'][0]
  row.update(backend=part['backend'], local_steps=setting['local_steps'],
             init_seconds=setting['cold_init_seconds'], first_round_seconds=setting['cold_first_round_seconds'],
             to_first_round_seconds=setting['cold_to_first_round_seconds'],
             compile_seconds=setting['cold_compile_seconds'], compilations=setting['cold_compilations'],
             round_seconds=setting['cold_round_seconds'], peak_device_mib=setting['fedjax_peak_device_mib'])
  return row


def main(_):
  variants = [v.strip() for v in FLAGS.variants.split(';') if v.strip()]
  if not variants:
    sys.exit('error: --variants is empty. Fix: e.g. --variants=\'default;--xla_gpu_autotune_level=0\'.')
  # This process writes the results (harness.machine() starts JAX's backend): on a GPU it must not take the memory
  # its cases need.
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'
  start = time.perf_counter()
  rows, backend = [], None
  settings = {'steps_per_client': FLAGS.steps_per_client, 'rounds': FLAGS.rounds, 'variants': ';'.join(variants)}
  for arch in FLAGS.archs:
    for variant in variants:
      limit = None
      if FLAGS.seconds:
        limit = FLAGS.seconds - (time.perf_counter() - start)
        if limit < 5:
          print(f'{arch} under {variant}: not started, --seconds={FLAGS.seconds} reached', flush=True)
          continue
      row = run_variant(arch, variant, limit)
      backend = row.get('backend', backend)
      rows.append(row)
      fmt = lambda key, f='.1f': '-' if row.get(key) is None else format(row[key], f)
      status = (f'stopped at {row["stopped_at_seconds"]:.0f} s' if 'stopped_at_seconds' in row else
                row.get('failed') or f'to first round {fmt("to_first_round_seconds")} s (compile '
                f'{fmt("compile_seconds")} s), round {fmt("round_seconds", ".3f")} s')
      print(f'{arch:>14} | {variant}: {status}', flush=True)
      write_results(FLAGS.out, f'xla_flags_{backend or "unknown"}', settings, rows, complete=False)
  write_results(FLAGS.out, f'xla_flags_{backend or "unknown"}', settings, rows)


if __name__ == '__main__':
  app_run(main)
