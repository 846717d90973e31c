"""benchmarks/gpu_sweep.sh and benchmarks/gpu_plan.py on the CPU at their tiny sizes, so that the accelerator sweep
cannot rot before a GPU is lent: the plan's analysis of a matmul by hand, the plan part writing one merged results
file, the report of parts run elsewhere, a scaling part's one process per method and host_cpu's one per thread
count, and scaling's row order and per-row results in the default suite; a part stopped at its share of the
command's time keeping its rows (one stopped before its first row, or killed without a time limit, named as not
finished), vmap_conv's record of a formulation that fails, the tiny sweep's parts (host_cpu, vs_pytorch, scaling
with two groups, plan, vmap_conv) and xla_flags.py's cold starts in the slow set."""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep(out, *parts):
  env = {**os.environ, 'TINY': '1'}
  done = subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu_sweep.sh'), str(out), *parts], env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(out / 'gpu_sweep_cpu.json') as f:
    return json.load(f)


def _check_plan(rows):
  assert [r['group'] for r in rows] == ['small_cnn', 'mlp', 'small_cnn_narrow']  # the quickstart's three
  for r in rows:
    assert r['gflop_per_round'] > 0 and r['kernels_per_step'] > 0
    assert r['gb_unfused_hlo_per_round'] >= r['gb_moved_per_round'] > 0  # unfused HLO moves more than the least
    # launches make the one-client loop the slower bound; both are at least the work's roofline
    assert r['loop_bound_seconds'] >= r['vmap_bound_seconds'] >= r['roofline_seconds'] > 0
    assert r['loops_inside_step'] == 0 and r['clients_fit'] > r['clients']


def test_the_plans_analysis_of_a_matmul_by_hand():
  code = ('import sys, json; sys.path.insert(0, "benchmarks"); import jax.numpy as jnp, gpu_plan; '
          'print(json.dumps(gpu_plan.analyse(lambda x, w: x @ w, jnp.zeros((4, 8)), jnp.zeros((8, 3)))))')
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  got = json.loads(done.stdout.strip().splitlines()[-1])
  # 2 M N K = 2 x 4 x 3 x 8 FLOPs; bytes: read x (32 floats) and w (24), write the result (12): 68 x 4, which is
  # also all that the one unfused dot accesses
  assert got == {'flops': 192.0, 'bytes': 272.0, 'unfused_bytes': 272.0, 'kernels': 1, 'loops': 0}


@pytest.mark.slow
def test_the_plan_part_writes_the_merged_results_file(tmp_path):
  merged = _sweep(tmp_path, 'plan')
  assert merged['tiny'] and list(merged['parts']) == ['gpu_plan_cpu']
  plan = merged['parts']['gpu_plan_cpu']
  assert plan['target'] == 'H100 SXM5' and plan['bandwidth'] == 3.35e12
  _check_plan(plan['rows'])


VS_ROW = {'num_clients': 10, 'local_steps': 111, 'torch_seconds_per_round': 1.877, 'fedjax_seconds_per_round': 1.809,
          'speedup_vs_torch': 1.0375, 'fedjax_first_round_seconds': 4.88, 'fedjax_compilations_first_round': 29,
          'fedjax_compilations_later': 0, 'fedjax_client_steps_per_second': 61.4, 'torch_client_steps_per_second': 59.1}
SCALING_ROWS = [{'algorithm': 'fedre', 'num_clients': 10, 'groups': 5, 'first_round_seconds': 4.32,
                 'compile_seconds': 5.42, 'compilations_first_round': 66, 'compilations_later_rounds': 0,
                 'seconds_per_round': 1.7, 'client_steps_per_second': 65.3, 'peak_memory_mib': 732.5,
                 'memory_kind': 'device_peak'},
                {'algorithm': 'fedre', 'num_clients': 1000, 'groups': 5, 'out_of_memory': True}]


def test_merge_reports_parts_run_elsewhere_and_an_unknown_part_is_named(tmp_path):
  (tmp_path / 'scaling_g5_fedre').mkdir()  # parts copied from separate commands or machines
  (tmp_path / 'vs_pytorch_cpu.json').write_text(json.dumps(
      {'backend': 'cpu', 'command': 'python benchmarks/vs_pytorch.py --num_clients=10', 'rows': [VS_ROW]}))
  (tmp_path / 'scaling_g5_fedre' / 'scaling_cpu.json').write_text(json.dumps(
      {'backend': 'cpu', 'complete': False, 'rows': SCALING_ROWS}))
  merged = _sweep(tmp_path, 'merge')
  assert sorted(merged['parts']) == ['scaling_g5_fedre/scaling_cpu', 'vs_pytorch_cpu']
  assert merged['parts']['vs_pytorch_cpu']['rows'] == [VS_ROW]
  report = (tmp_path / 'gpu_sweep_cpu.md').read_text()
  assert '`python benchmarks/vs_pytorch.py --num_clients=10`' in report
  assert '| 10 | 111 | 1.877 | 1.809 | 1.04x | 4.9 | 29 / 0 | 61 / 59 |' in report
  assert '## scaling_g5_fedre/scaling_cpu (stopped at its time limit after 2 rows)' in report
  assert '| fedre | 10 | 5 | 4.32 | 5.42 | 66 / 0 | 1.700 | 65.3 | 732 |' in report
  assert '| fedre | 1000 | 5 | out of memory |' in report
  assert (tmp_path / 'gpu_sweep_cpu.png').read_bytes()[:4] == b'\x89PNG'
  done = subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu_sweep.sh'), str(tmp_path), 'scaling_g3'],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and "unknown part 'scaling_g3'" in done.stderr
  done = subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu_sweep.sh'), str(tmp_path), 'plan'],
                        env={**os.environ, 'SWEEP_SECONDS': '9m'}, capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and "SWEEP_SECONDS='9m' is not a whole number of seconds" in done.stderr


def test_the_report_is_named_after_the_accelerator_though_host_cpu_parts_ran_on_its_cpu():
  sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
  import sweep_report
  host, gpu = {'backend': 'cpu'}, {'backend': 'gpu'}
  assert sweep_report.sweep_backend({'host_cpu_t2/vs_pytorch_cpu': host, 'vs_pytorch_gpu': gpu}) == 'gpu'
  assert sweep_report.sweep_backend({'host_cpu_t2/vs_pytorch_cpu': host}) == 'cpu'
  assert sweep_report.sweep_backend({}) == 'none'


FAKE_PYTHON = """#!/usr/bin/env bash
# Runs the report for real; a benchmark part writes one finished row holding its arguments, as after its first
# row (unless it is $NOROW), then hangs if it is $HANG, or exits with $EXIT.
[ "$1" = sweep_report.py ] && exec "$REAL_PYTHON" "$@"
echo "$1" >> "${CALLS:-/dev/null}"
for a in "$@"; do case "$a" in --out=*) out="${a#--out=}" ;; esac; done
mkdir -p "$out"
[ "$1" = "${NOROW:-}" ] || echo '{"backend": "cpu", "complete": false, "rows": [{"num_clients": 10,
  "torch_seconds_per_round": 2.0, "fedjax_seconds_per_round": 1.0, "args": "'"$*"'",
  "jax_platforms": "'"${JAX_PLATFORMS:-}"'"}]}' > "$out/${1%.py}_cpu.json"
[ "$1" = "${HANG:-}" ] && exec sleep 60
exit "${EXIT:-0}"
"""


def _fake_python(tmp_path, **env):
  fake = tmp_path / 'python'
  fake.write_text(FAKE_PYTHON)
  fake.chmod(0o755)
  return {**os.environ, 'PYTHON': str(fake), 'REAL_PYTHON': sys.executable, **env}


def _sweep_with(env, out, *parts):
  return subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu_sweep.sh'), str(out), *parts], env=env,
                        capture_output=True, text=True, timeout=60)


def test_scaling_runs_each_method_and_host_cpu_each_thread_count_up_to_the_cores_in_its_own_process(tmp_path):
  # OpenMP's thread limit is not the machine's cores
  done = _sweep_with(_fake_python(tmp_path, JAX_PLATFORMS='', OMP_NUM_THREADS='1', ALGORITHMS='fedre fedavg'),
                     tmp_path, 'scaling_g10', 'host_cpu')
  assert done.returncode == 0, done.stderr[-3000:]
  parts = json.loads((tmp_path / 'gpu_sweep_cpu.json').read_text())['parts']
  threads = [t for t in (2, 4, 8, 16) if t <= len(os.sched_getaffinity(0))]
  assert sorted(parts) == sorted([f'host_cpu_t{t}/vs_pytorch_cpu' for t in threads] +
                                 ['scaling_g10_fedavg/scaling_cpu', 'scaling_g10_fedre/scaling_cpu'])
  for algorithm in ('fedre', 'fedavg'):
    args = parts[f'scaling_g10_{algorithm}/scaling_cpu']['rows'][0]['args'].split()
    assert args[0] == 'scaling.py' and f'--algorithms={algorithm}' in args and '--groups=10' in args
    assert '--num_clients=10' in args  # several groups: 10 clients, their compilation
    assert f'--out={tmp_path}/scaling_g10_{algorithm}' in args
  for t in threads:
    row = parts[f'host_cpu_t{t}/vs_pytorch_cpu']['rows'][0]
    assert row['jax_platforms'] == 'cpu'  # the host's CPU, also where an accelerator is
    args = row['args'].split()
    assert args[0] == 'vs_pytorch.py' and f'--client_threads={t}' in args and '--strategy=sequential' in args


@pytest.mark.slow
def test_a_part_is_stopped_at_its_share_of_the_time_keeping_its_rows_and_one_without_time_does_not_start(tmp_path):
  # 22 s, less 15 for the report: the first of two parts would get 7 / 2 = 3 s, under the 5 s a part needs, so it
  # does not start; the second gets the 7 s (6 where a second passed) and is stopped there.
  done = _sweep_with(_fake_python(tmp_path, SWEEP_SECONDS='22', HANG='vs_pytorch.py'), tmp_path, 'plan', 'vs_pytorch')
  assert done.returncode == 1, done.stderr[-3000:]
  assert 'part plan not started: its share of SWEEP_SECONDS=22 would be 3 s' in done.stderr
  assert re.search(r'part vs_pytorch stopped at its share of SWEEP_SECONDS \([67] s\); the rows it finished are kept',
                   done.stderr)
  assert 'these parts did not finish: plan (not started)' in done.stderr
  report = (tmp_path / 'gpu_sweep_cpu.md').read_text()
  assert list(json.loads((tmp_path / 'gpu_sweep_cpu.json').read_text())['parts']) == ['vs_pytorch_cpu']
  assert '## vs_pytorch_cpu (stopped at its time limit after 1 rows)' in report


@pytest.mark.slow
def test_the_time_shares_are_weighted_paper_settings_3_xla_flags_2_the_others_1(tmp_path):
  # 24 s, less 15 for the report: xla_flags (weight 2 of 3) gets 9 * 2 / 3 = 6 s (5 where a second passed) and is
  # stopped there; with equal shares it would get 4 s and not start. plan is then left under 5 s.
  done = _sweep_with(_fake_python(tmp_path, SWEEP_SECONDS='24', HANG='xla_flags.py'), tmp_path, 'xla_flags', 'plan')
  assert done.returncode == 1, done.stderr[-3000:]
  assert re.search(r'part xla_flags stopped at its share of SWEEP_SECONDS \([56] s\)', done.stderr), done.stderr
  assert 'these parts did not finish: plan (not started)' in done.stderr


@pytest.mark.slow
def test_a_part_stopped_before_its_first_row_or_killed_without_a_time_limit_is_named_as_not_finished(tmp_path):
  done = _sweep_with(_fake_python(tmp_path, SWEEP_SECONDS='21', HANG='vs_pytorch.py', NOROW='vs_pytorch.py'),
                     tmp_path / 'a', 'vs_pytorch')
  assert done.returncode == 1, done.stderr[-3000:]
  assert 'these parts did not finish: vs_pytorch (stopped before its first row)' in done.stderr
  # Exit 137 (the kernel's OOM killer) without SWEEP_SECONDS is a failure, not a time limit.
  done = _sweep_with(_fake_python(tmp_path, EXIT='137'), tmp_path / 'b', 'plan')
  assert done.returncode == 1 and 'these parts did not finish: plan (exit 137)' in done.stderr


STOPPED_SCALING = """
import os, sys
sys.path.insert(0, 'benchmarks')
from absl import app
import scaling
scaling.FLAGS(['scaling', '--algorithms=fedre,fedavg', '--num_clients=4,8', '--models=mlp',
               '--group_family=small_cnn', '--groups=3', '--out=' + sys.argv[1]])
try:
  scaling.main(None)
except app.UsageError as e:
  print('usage:', e)
scaling.FLAGS.groups = ['1']
done = []
def measure(algorithm, k, groups, model, batch):
  if len(done) == 3:
    os._exit(3)  # the process is killed during its fourth row
  done.append(k)
  return dict(first_round_seconds=1.0, compile_seconds=1.0, compilations_first_round=1, compilations_later_rounds=0,
              seconds_per_round=0.5 * k, client_steps_per_second=1.0, peak_memory_mib=1.0)
scaling.measure = measure
scaling.main(None)
"""


def test_scaling_keeps_each_finished_row_smaller_client_counts_first_and_names_too_few_architectures(tmp_path):
  done = subprocess.run([sys.executable, '-c', STOPPED_SCALING, str(tmp_path)], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 3, done.stderr[-3000:]
  assert ('usage: --groups=3 needs as many distinct architectures, but --models mlp with --group_family gives 2. '
          'Fix: add architectures to --group_family or sweep fewer --groups.') in done.stdout
  results = json.loads((tmp_path / 'scaling_cpu.json').read_text())
  assert results['complete'] is False
  assert [(r['algorithm'], r['num_clients'], r['seconds_per_round']) for r in results['rows']] == [
      ('fedre', 4, 2.0), ('fedavg', 4, 2.0), ('fedre', 8, 4.0)]


@pytest.mark.slow
def test_the_whole_tiny_sweep_runs_every_part(tmp_path):
  merged = _sweep(tmp_path)
  assert sorted(merged['parts']) == ['gpu_plan_cpu', 'host_cpu_t1/vs_pytorch_cpu', 'host_cpu_t2/vs_pytorch_cpu',
                                     'scaling_g2_fedre/scaling_cpu', 'vs_pytorch_cpu']
  vs = merged['parts']['vs_pytorch_cpu']['rows']
  assert [r['num_clients'] for r in vs] == [2] and vs[0]['speedup_vs_torch'] > 0
  scaling = merged['parts']['scaling_g2_fedre/scaling_cpu']['rows']
  assert [(r['num_clients'], r['groups']) for r in scaling] == [(4, 2)] and scaling[0]['peak_memory_mib'] > 0
  assert scaling[0]['compilations_first_round'] > 0
  _check_plan(merged['parts']['gpu_plan_cpu']['rows'])


PAPER_ROW = {'setting': 'fedre_table1', 'num_clients': 10, 'architectures': 10, 'local_steps': 10,
             'cold_to_first_round_seconds': 201.3, 'warm_to_first_round_seconds': 40.2,
             'torch_to_first_round_seconds': 20.5, 'fedjax_round_seconds': 5.25, 'torch_round_seconds': 7.5,
             'speedup_vs_torch': 7.5 / 5.25, 'fedjax_peak_rss_mib': 3000.4, 'torch_peak_rss_mib': 2500.6}
PAPER_ARCH_ROW = {'setting': 'fedre_table1', 'arch': 'vit_b16', 'clients': 1, 'fedjax_first_round_cold_seconds': 30.0,
                  'fedjax_first_round_warm_seconds': 3.0, 'torch_first_round_seconds': 2.5,
                  'fedjax_round_seconds': 1.25, 'torch_round_seconds': 1.5}


def test_the_paper_settings_part_runs_first_at_the_tables_sizes_and_its_tables_are_reported(tmp_path):
  calls = tmp_path / 'calls'
  done = _sweep_with(_fake_python(tmp_path, JAX_PLATFORMS='', CALLS=str(calls)), tmp_path / 'a')
  assert done.returncode == 0, done.stderr[-3000:]
  assert calls.read_text().split() == ['paper_settings.py', 'vs_pytorch.py', 'scaling.py', 'scaling.py']
  parts = json.loads((tmp_path / 'a' / 'gpu_sweep_cpu.json').read_text())['parts']
  args = parts['paper_settings/paper_settings_cpu']['rows'][0]['args'].split()
  assert '--settings=fedre_table1,fedre_table1_20,gefl_table2,felo_table2' in args and '--rounds=2' in args
  assert not any(a.startswith('--steps_per_client') for a in args)  # the tables' step counts
  (tmp_path / 'b' / 'paper_settings').mkdir(parents=True)
  for name, row in (('paper_settings_cpu', PAPER_ROW), ('paper_settings_archs_cpu', PAPER_ARCH_ROW)):
    (tmp_path / 'b' / 'paper_settings' / f'{name}.json').write_text(json.dumps({'backend': 'cpu', 'rows': [row]}))
  _sweep(tmp_path / 'b', 'merge')
  report = (tmp_path / 'b' / 'gpu_sweep_cpu.md').read_text()
  assert '| fedre_table1 | 10 | 10 | 10 | 201.3 / 40.2 | 20.5 | 5.250 | 7.500 | 1.43x | - | 3000 / 2501 |' in report
  assert '| fedre_table1 | vit_b16 | 1 | 30.00 / 3.00 | 2.50 | 1.250 | 1.500 |' in report


@pytest.mark.slow  # a cold start per variant (about 20 s on a 2-core CPU)
def test_xla_flags_times_a_cold_start_per_variant_and_records_a_variant_that_fails(tmp_path):
  """benchmarks/xla_flags.py over cnn4 (one FedRE client, one local step): the default variant's cold case
  (paper_settings.py --cases=cold) gives its start, compilations and round; an XLA flag that XLA rejects is a
  row that says the case failed, and the run goes on to write its results."""
  done = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'xla_flags.py'), '--archs=cnn4',
                         '--variants=default;--xla_no_such_flag=1', '--steps_per_client=1', '--rounds=1',
                         f'--out={tmp_path}'], capture_output=True, text=True, timeout=600,
                        env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((tmp_path / 'xla_flags_cpu.json').read_text())['rows']
  assert [(r['arch'], r['xla_flags']) for r in rows] == [('cnn4', 'default'), ('cnn4', '--xla_no_such_flag=1')]
  default, bad = rows
  assert default['local_steps'] == 1 and default['compilations'] > 0
  assert default['to_first_round_seconds'] >= default['first_round_seconds'] > 0 and default['round_seconds'] > 0
  assert bad['failed'].startswith('exit ') and 'round_seconds' not in bad
  assert 'cnn4 | --xla_no_such_flag=1: exit ' in done.stdout


@pytest.mark.slow
def test_the_vmap_conv_part_times_im2col_and_the_pallas_kernels_side_by_side_and_conv_reaches_whole_rounds(tmp_path):
  """The vmap_conv part at its tiny size (Pallas's interpreter on the CPU) and its table in the report; CONV=pallas
  passes the formulation to the parts that time whole rounds."""
  merged = _sweep(tmp_path / 'a', 'vmap_conv')
  rows = merged['parts']['vmap_conv/vmap_conv_cpu']['rows']
  assert [(r['what'], r['formulation'], r['clients']) for r in rows] == [('cnn4_conv2', 'im2col', 2),
                                                                          ('cnn4_conv2', 'pallas', 2)]
  assert all(r['forward_backward_ms'] > 0 for r in rows)
  assert '| cnn4_conv2 | pallas | 2 | - | - |' in (tmp_path / 'a' / 'gpu_sweep_cpu.md').read_text()
  done = _sweep_with(_fake_python(tmp_path, JAX_PLATFORMS='', CONV='pallas'), tmp_path / 'b', 'vs_pytorch',
                     'scaling_g1')
  assert done.returncode == 0, done.stderr[-3000:]
  parts = json.loads((tmp_path / 'b' / 'gpu_sweep_cpu.json').read_text())['parts']
  for name in ('vs_pytorch_cpu', 'scaling_g1_fedre/scaling_cpu'):
    assert '--conv=pallas' in parts[name]['rows'][0]['args'].split()


FAILING_PALLAS = """
import sys
sys.path.insert(0, 'benchmarks')
from absl import app
import vmap_conv
vmap_conv.FLAGS(['vmap_conv', '--clients=2', '--batch_size=2', '--layers=cnn4_conv2', '--formulations=pallas,im2col',
                 '--nobf16', '--repeats=1', '--out=' + sys.argv[1]])
for name in ('step_program', 'layer_programs'):
  real = getattr(vmap_conv, name)
  def failing(model_or_layer, formulation, *rest, real=real):
    if formulation == 'pallas':
      raise RuntimeError('Triton compilation failed\\nmore')
    return real(model_or_layer, formulation, *rest)
  setattr(vmap_conv, name, failing)
vmap_conv.main(None)
vmap_conv.FLAGS.formulations = ['im2col', 'winograd']
try:
  vmap_conv.main(None)
except app.UsageError as e:
  print('usage:', e)
"""


@pytest.mark.slow
def test_vmap_conv_records_a_formulation_that_fails_and_times_the_others(tmp_path):
  done = subprocess.run([sys.executable, '-c', FAILING_PALLAS, str(tmp_path)], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  rows = json.loads((tmp_path / 'vmap_conv_cpu.json').read_text())['rows']
  assert [(r['what'], r['formulation'], r.get('failed')) for r in rows] == [
      ('cnn4 step', 'pallas', 'RuntimeError: Triton compilation failed'), ('cnn4 step', 'im2col', None),
      ('cnn4_conv2', 'pallas', 'RuntimeError: Triton compilation failed'), ('cnn4_conv2', 'im2col', None)]
  assert rows[1]['client_steps_per_second'] > 0 and rows[3]['forward_backward_ms'] > 0
  assert 'usage: --formulations: unknown winograd. Fix: choose from xla, im2col' in done.stdout


def test_an_xla_flags_variant_gives_xla_its_flags_and_paper_settings_the_scan_flag():
  # in a process of its own: xla_flags.py defines absl flags (--rounds, --out) that dp_audit.py defines too
  code = ('import sys, json; sys.path.insert(0, "benchmarks"); import xla_flags; print(json.dumps([xla_flags.'
          'split_variant(v) for v in ("default", "--scan_blocks", "--xla_a=0 --scan_blocks --xla_b=1")]))')
  done = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, check=True)
  assert json.loads(done.stdout.strip().splitlines()[-1]) == [
      ['', []], ['', ['--scan_blocks']], ['--xla_a=0 --xla_b=1', ['--scan_blocks']]]
