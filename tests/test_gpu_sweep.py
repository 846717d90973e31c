"""benchmarks/gpu_sweep.sh and benchmarks/gpu_plan.py on the CPU at their tiny sizes, so that the accelerator sweep
cannot rot before a GPU is lent: the plan's analysis of a matmul by hand, the plan part writing one merged results
file and the merge of parts run elsewhere in the default suite, and the tiny sweep's parts (vs_pytorch, scaling
with two groups, plan) in the slow set."""

import json
import os
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


def test_the_plan_part_writes_the_merged_results_file(tmp_path):
  merged = _sweep(tmp_path, 'plan')
  assert merged['tiny'] and list(merged['parts']) == ['gpu_plan_cpu']
  plan = merged['parts']['gpu_plan_cpu']
  assert plan['target'] == 'H100 SXM5' and plan['bandwidth'] == 3.35e12
  _check_plan(plan['rows'])


def test_merge_gathers_parts_run_elsewhere_and_an_unknown_part_is_named(tmp_path):
  (tmp_path / 'scaling_g5').mkdir()  # parts copied from separate commands or machines
  for name, backend in [('vs_pytorch_cpu.json', 'cpu'), ('scaling_g5/scaling_cpu.json', 'cpu')]:
    (tmp_path / name).write_text(json.dumps({'backend': backend, 'rows': [{'num_clients': 10}]}))
  merged = _sweep(tmp_path, 'merge')
  assert sorted(merged['parts']) == ['scaling_g5/scaling_cpu', 'vs_pytorch_cpu']
  assert merged['parts']['vs_pytorch_cpu']['rows'] == [{'num_clients': 10}]
  done = subprocess.run(['bash', os.path.join(ROOT, 'benchmarks', 'gpu_sweep.sh'), str(tmp_path), 'scaling_g3'],
                        capture_output=True, text=True, timeout=60)
  assert done.returncode == 2 and "unknown part 'scaling_g3'" in done.stderr


@pytest.mark.slow
def test_the_whole_tiny_sweep_runs_every_part(tmp_path):
  merged = _sweep(tmp_path)
  assert sorted(merged['parts']) == ['gpu_plan_cpu', 'scaling_g2/scaling_cpu', 'vs_pytorch_cpu']
  vs = merged['parts']['vs_pytorch_cpu']['rows']
  assert [r['num_clients'] for r in vs] == [2] and vs[0]['speedup_vs_torch'] > 0
  scaling = merged['parts']['scaling_g2/scaling_cpu']['rows']
  assert [(r['num_clients'], r['groups']) for r in scaling] == [(4, 2)] and scaling[0]['peak_memory_mib'] > 0
  assert scaling[0]['compilations_first_round'] > 0
  _check_plan(merged['parts']['gpu_plan_cpu']['rows'])
