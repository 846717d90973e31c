"""An empirical lower bound on grouped FedAvg's epsilon under central DP, from one run with canary clients.

  python benchmarks/dp_audit.py --canaries=1000 --dim=20000 --noise_multipliers=0.5,1,2,4 --rounds=1
  python benchmarks/dp_audit.py --noise_fraction=0.1 ...   # a run that draws a tenth of its noise: caught

The one-run audit of "Privacy Auditing with One (1) Training Run" (Steinke, Nasr and Jagielski, NeurIPS 2023,
Sec. 3 and its Algorithm 1's p-value): m canary clients, each included in the federation independently with
probability 1/2. An included canary takes part in every round and uploads the group model plus a secret direction
of norm 2C (its own unit vector, drawn independently of the others), which the client side of `privacy.dp` clips to
C, exactly as it clips a real client's model delta; an excluded one does not exist. The server is grouped FedAvg's
own (`average_group_models`) behind `privacy.dp.privatize` in central mode, which noises the group's sum once with
N(0, sigma^2 C^2) per coordinate, as a real run does. The auditor sees only the released group models; it scores
each canary by the inner product of the model's total change with that canary's direction, guesses "included" for
the k highest scores and "excluded" for the k lowest (k fixed in advance: --guesses; the rest abstain), and counts
the correct guesses W. If the run were (epsilon, delta)-DP for neighbours that add or remove a client, W could
exceed a Binomial(2k, e^eps / (1 + e^eps)) count only with the paper's small delta term; the largest epsilon whose
p-value for the observed W is below --confidence's complement is the empirical lower bound.

Printed beside it: the epsilon the library accounts for the run (replace-one clients, sensitivity 2C: what
summary.json reports) and the add/remove epsilon of the same noise (sensitivity C), which is what this audit's
neighbours are; a lower bound above the add/remove epsilon would show a flaw in the clipping, the noise or the
accounting. The lower bound of a one-run audit is known to be loose (it tests many canaries at once, each with one
bit of evidence); it is a check that the implementation is not grossly wrong, not an estimate of the true epsilon.
Writes benchmarks/results/dp_audit_cpu.json and .csv.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from absl import flags

from fedjax_het.run.cli import app_run

import dp_accounting
from harness import RESULTS, write_results

from fedjax_het.core import Algorithm, ClientProgram, Phase, Uploads, single_stage
from fedjax_het.engine.schedule import Schedule
from fedjax_het.local_training import LocalTraining
from fedjax_het.methods.fedavg import GROUP_MODEL_PRIVACY, GroupModel, GroupModels, average_group_models
from fedjax_het.privacy.budget import PrivacyBudget, gaussian_epsilon
from fedjax_het.privacy.dp import DPConfig, privatize

flags.DEFINE_integer('canaries', 1000, 'm: canary clients, each included with probability 1/2.')
flags.DEFINE_integer('dim', 20000, 'Parameters of the (flat) group model.')
flags.DEFINE_list('noise_multipliers', ['1', '2', '4'], 'sigma values to audit.')
flags.DEFINE_integer('rounds', 1, 'Rounds every included canary takes part in.')
flags.DEFINE_integer('guesses', 0, 'k: guesses "included" and k "excluded" (0: m / 10 each).')
flags.DEFINE_float('clip', 1.0, 'C.')
flags.DEFINE_float('delta', 1e-5, 'delta of the accounted and the audited epsilon.')
flags.DEFINE_float('confidence', 0.95, 'Confidence of the lower bound.')
flags.DEFINE_integer('seed', 0, 'Seed of the canaries, their inclusion and the noise.')
flags.DEFINE_float('noise_fraction', 1.0, 'Draw only this fraction of the accounted noise (a deliberately broken '
                   'run: below 1, the audit should find more than the accounted epsilon).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


def audit_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
  """P-value of v correct guesses of r among m canaries if the run were (eps, delta)-DP (add/remove): the
  Binomial(r, e^eps / (1 + e^eps)) tail at v, plus the paper's delta term 2 m delta max_i P[v - i <= B < v] / i."""
  q = 1.0 / (1.0 + math.exp(-eps))
  tail = scipy.stats.binom.sf(v - 1, r, q)
  below = np.cumsum(scipy.stats.binom.pmf(v - np.arange(1, v + 1), r, q))  # P[v - i <= B < v], i = 1..v
  worst = float(np.max(below / np.arange(1, v + 1))) if v else 0.0
  return min(1.0, float(tail + 2 * m * delta * worst))


def audit_epsilon(m: int, r: int, v: int, delta: float, confidence: float) -> float:
  """The largest epsilon (bisection, 1e-3) whose p-value for v correct of r guesses is below 1 - confidence: with
  that confidence the run is not (epsilon, delta)-DP; 0 where even epsilon 0 is not rejected."""
  beta = 1.0 - confidence
  if audit_p_value(m, r, v, 0.0, delta) >= beta:
    return 0.0
  low, high = 0.0, 1.0
  while audit_p_value(m, r, v, high, delta) < beta:
    low, high = high, 2 * high
  while high - low > 1e-3:
    mid = (low + high) / 2
    low, high = (mid, high) if audit_p_value(m, r, v, mid, delta) < beta else (low, mid)
  return low


def canary_federation(sigma: float, clip: float):
  """Grouped FedAvg's server step and DP declaration on a flat model, with clients that upload their broadcast
  model plus their canary direction: (client final, server update) of the privatized method."""
  def final(carry, rows, broadcast, key):
    return carry, GroupModel(broadcast.model + carry)  # carry: the canary's direction, norm 2C
  program = ClientProgram(lambda c, b, k: c, single_stage(lambda c, b, bc, k: (c, 0.0), LocalTraining(0.1, 1, 1)),
                          final, LocalTraining(0.1, 1, 1))
  method = Algorithm('fedavg_canaries', None, (Phase('round', lambda g: program,
                                                     lambda s, u, k: (average_group_models(s, u), {})),), None,
                     upload_privacy=GROUP_MODEL_PRIVACY)
  private = privatize(method, DPConfig('central', clip=clip, noise_multiplier=sigma)).phases[0]
  return private.client(None).final, private.server_update


def audit(sigma: float, rng: np.random.Generator, key: jax.Array) -> dict:
  m, d, clip = FLAGS.canaries, FLAGS.dim, FLAGS.clip
  directions = rng.normal(size=(m, d)).astype(np.float32)
  directions /= np.linalg.norm(directions, axis=1, keepdims=True)
  included = rng.random(m) < 0.5
  final, server_update = canary_federation(sigma * FLAGS.noise_fraction, clip)
  send = jax.jit(jax.vmap(lambda u, b, k: final(u, None, b, k)[1], in_axes=(0, None, 0)))
  step = jax.jit(server_update)
  server = GroupModels((jnp.zeros(d, jnp.float32),))
  members = jnp.asarray(2 * clip * directions[included])
  for r in range(FLAGS.rounds):
    key, upload_key, server_key = jax.random.split(key, 3)
    broadcast = GroupModel(server.models[0])
    sent = send(members, broadcast, jax.random.split(upload_key, len(members)))
    uploads = Uploads(sent, jnp.ones(len(members), bool), jnp.ones(len(members), jnp.float32))
    server, _ = step(server, (uploads,), server_key)
  change = np.asarray(server.models[0])
  scores = directions @ change
  k = FLAGS.guesses or m // 10
  order = np.argsort(scores)
  correct = int(included[order[-k:]].sum() + (~included[order[:k]]).sum())
  schedule = Schedule('fedavg', (Phase('round', None, None),), m, FLAGS.rounds)
  replace_one = PrivacyBudget(schedule, 'central', sigma, FLAGS.delta, 'pld', hides_participants=False,
                              allow_large_delta=True).epsilon(FLAGS.rounds)
  add_remove = gaussian_epsilon(sigma / math.sqrt(FLAGS.rounds), FLAGS.delta)
  return {'noise_multiplier': sigma, 'canaries': m, 'included': int(included.sum()), 'dim': d,
          'rounds': FLAGS.rounds, 'guesses': 2 * k, 'correct': correct,
          'audited_epsilon_lower_bound': audit_epsilon(m, 2 * k, correct, FLAGS.delta, FLAGS.confidence),
          'accounted_epsilon_add_remove': add_remove, 'accounted_epsilon_replace_one': replace_one,
          'noise_fraction': FLAGS.noise_fraction, 'delta': FLAGS.delta, 'confidence': FLAGS.confidence}


def main(_):
  rng = np.random.default_rng(FLAGS.seed)
  key = jax.random.PRNGKey(FLAGS.seed)
  rows = []
  print(f'{"sigma":>6} {"correct":>10} | {"audit eps >=":>12} {"add/remove eps":>14} {"reported eps":>12}')
  for sigma in (float(s) for s in FLAGS.noise_multipliers):
    key, sub = jax.random.split(key)
    row = audit(sigma, rng, sub)
    rows.append(row)
    print(f'{sigma:6.2f} {row["correct"]:5d}/{row["guesses"]:<4d} | {row["audited_epsilon_lower_bound"]:12.3f} '
          f'{row["accounted_epsilon_add_remove"]:14.3f} {row["accounted_epsilon_replace_one"]:12.3f}', flush=True)
    write_results(FLAGS.out, f'dp_audit_{jax.default_backend()}', {'seed': FLAGS.seed}, rows, complete=False)
  write_results(FLAGS.out, f'dp_audit_{jax.default_backend()}', {'seed': FLAGS.seed}, rows)


if __name__ == '__main__':
  app_run(main)
