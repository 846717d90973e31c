"""Start-up cost of a run: seconds and XLA compilations of `Federation.init` (every group's classifier and the
method's per-client state) and of its first round, without XLA's persistent compilation cache, with an empty cache
(cold) and with the cache the cold run filled (warm: another seed of a sweep, a resumed run). Each case runs in
a fresh process, side by side in one invocation.

  python benchmarks/startup.py --flagfile=experiments/flags/gefl_mnist5k.flags [--rounds_timed=1]

Writes benchmarks/results/startup_<name of the flag file>.json/.csv.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from fedjax_het.run.cli import app_run

flags.DEFINE_string('flagfile_path', None, 'The experiment flag file (its data, models and method).')
flags.DEFINE_integer('rounds_timed', 1, 'Rounds run and timed after init (0: init only).')
flags.DEFINE_string('child_cache', None, 'Internal: run one case in this process with this cache folder ("" off).')
flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results'), 'Output folder.')
FLAGS = flags.FLAGS


def one_case() -> dict:
  """Times init and the first rounds of the flag file's federation in this process."""
  import jax
  from harness import CompileLog
  from fedjax_het.run import cli
  from fedjax_het.run.compilation_cache import use_compilation_cache
  from fedjax_het.run.experiment import build_federation
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['startup', f'--flagfile={FLAGS.flagfile_path}', '--workdir=unused'], fv)
  use_compilation_cache(FLAGS.child_cache)
  fed = build_federation(cli.config_from_flags(fv))
  row = {}
  with CompileLog() as log:
    t0 = time.perf_counter()
    state = jax.block_until_ready(fed.init())
    row.update(init_seconds=time.perf_counter() - t0, init_compilations=len(log.durations),
               init_compile_seconds=sum(log.durations))
  with CompileLog() as log:
    t0 = time.perf_counter()
    for _ in range(FLAGS.rounds_timed):
      state, _ = fed.round(state)
    jax.block_until_ready(state)
    row.update(rounds_seconds=time.perf_counter() - t0, rounds_compilations=len(log.durations),
               rounds_compile_seconds=sum(log.durations))
  return row


def main(argv):
  if FLAGS.child_cache is not None:
    print(json.dumps(one_case()))
    return
  if not FLAGS.flagfile_path:
    sys.exit('error: --flagfile_path: give the experiment flag file, e.g. experiments/flags/gefl_mnist5k.flags')
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  rows = []
  with tempfile.TemporaryDirectory() as folder:
    for case, cache in [('no cache', ''), ('cache, cold', folder), ('cache, warm', folder)]:
      result = subprocess.run([sys.executable, __file__, f'--flagfile_path={FLAGS.flagfile_path}',
                               f'--rounds_timed={FLAGS.rounds_timed}', f'--child_cache={cache}'],
                              capture_output=True, text=True, env=env)
      if result.returncode:
        sys.exit(f'error: the case {case!r} failed:\n{result.stderr[-3000:]}')
      row = {'case': case, **json.loads(result.stdout.strip().splitlines()[-1])}
      rows.append(row)
      print(f'{case}: init {row["init_seconds"]:.1f} s ({row["init_compilations"]} compilations, '
            f'{row["init_compile_seconds"]:.1f} s compiling); {FLAGS.rounds_timed} round(s) '
            f'{row["rounds_seconds"]:.1f} s ({row["rounds_compile_seconds"]:.1f} s compiling)', flush=True)
  from harness import write_results
  name = os.path.splitext(os.path.basename(FLAGS.flagfile_path))[0]
  write_results(FLAGS.out, f'startup_{name}', {'flagfile': FLAGS.flagfile_path, 'rounds_timed': FLAGS.rounds_timed},
                rows)


if __name__ == '__main__':
  app_run(main)
