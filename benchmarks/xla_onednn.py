"""XLA's own oneDNN path against the library's oneDNN custom call, on the CPU: one SGD step of cnn4 (batch 32,
32x32x3 inputs), milliseconds, best of 3 after a warm-up, each case in a fresh process (XLA reads XLA_FLAGS once
per process), side by side in one invocation.

  python benchmarks/xla_onednn.py

Cases, each as 10 steps driven from the host and as 10 steps in one `lax.scan` (how a round runs its local steps):
  xla:            --conv=xla, XLA:CPU's own convolutions;
  xla+onednn:     --conv=xla with XLA_FLAGS=--xla_cpu_use_onednn=true (XLA's rewrite of convolutions and matmuls
                  to oneDNN, in the jaxlib at hand);
  onednn:         --conv=onednn, the library's custom call (kernels/onednn.py), left out, said so, where the
                  `onednn` extra is not installed.
Prints the table and writes benchmarks/results/xla_onednn.json/.csv.
"""

import json
import os
import subprocess
import sys

from absl import flags

from fedjax_het.run.cli import app_run

from harness import RESULTS

flags.DEFINE_string('case', None, 'Internal: run one case in this process and print its figures as JSON.')
flags.DEFINE_string('out', RESULTS, 'Output folder.')
FLAGS = flags.FLAGS
CASES = {'xla': ('xla', ''), 'xla+onednn': ('xla', '--xla_cpu_use_onednn=true'), 'onednn': ('onednn', '')}
STEPS = 10


def one_case(conv: str) -> dict:
  """Milliseconds per step of cnn4's SGD step with convolutions `conv`, host-driven and in a scan."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from harness import best_seconds, sgd_step_fn
  from fedjax_het.models import build_model
  model = build_model('cnn4', 10, 512, conv=conv)
  step, carry = sgd_step_fn(model, model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))['params'])
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(32, 32, 32, 3)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, 10, 32).astype(np.int32))
  one = jax.jit(step)

  def host():
    c = carry
    for _ in range(STEPS):
      c, _ = one(c, x, y)
    return c
  scanned = jax.jit(lambda c: jax.lax.scan(lambda c, _: step(c, x, y), c, None, length=STEPS)[0])
  return {'host_ms': 1e3 * best_seconds(host) / STEPS, 'scan_ms': 1e3 * best_seconds(lambda: scanned(carry)) / STEPS}


def main(_):
  if FLAGS.case:
    print(json.dumps(one_case(CASES[FLAGS.case][0])))
    return
  from harness import write_results
  from fedjax_het.kernels import onednn
  rows = []
  for name, (conv, xla_flags) in CASES.items():
    if conv == 'onednn' and onednn.unavailable_reason() is not None:
      print(f'{name}: left out ({onednn.unavailable_reason()})')
      continue
    env = {**os.environ, 'XLA_FLAGS': (os.environ.get('XLA_FLAGS', '') + ' ' + xla_flags).strip()}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f'--case={name}'], env=env, check=True,
                         capture_output=True, text=True).stdout
    figures = json.loads(out.strip().splitlines()[-1])
    rows.append({'case': name, 'xla_flags': xla_flags, **{k: round(v, 2) for k, v in figures.items()}})
    write_results(FLAGS.out, 'xla_onednn', {}, rows, complete=False)
  for r in rows:
    print(f"{r['case']:>11}: {r['host_ms']:7.2f} ms per step from the host, {r['scan_ms']:7.2f} in a scan")
  write_results(FLAGS.out, 'xla_onednn', {}, rows)


if __name__ == '__main__':
  app_run(main)
