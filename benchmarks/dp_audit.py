"""An empirical lower bound on epsilon from one DP run of the `Federation`, with canary clients, beside the epsilon
the library accounts for that run.

  python benchmarks/dp_audit.py                            # every mode at sigma 2 and 4, 1,024 canaries
  python benchmarks/dp_audit.py --noise_fraction=0.1       # a run that draws a tenth of its noise: caught

The one-run audit of "Privacy Auditing with One (1) Training Run" (Steinke, Nasr and Jagielski, NeurIPS 2023,
Sec. 3 and its Algorithm 1's p-value). Every client of the federation is a canary whose one training row holds a
number and a secret bit S_i, drawn at random: its contribution to the model is the bit times a direction of the
model's parameters that the number names (`canary_direction`: dense, orthogonal to every other canary's; norm
--canary_norm x C before the DP layer clips it to C). Where the library accounts replace-one neighbours (central
and local under a fixed-size draw) the bit is +1 or -1, so flipping it replaces the client by another; where it
accounts add/remove neighbours (central under Poisson sampling with the fixed denominator) it is 1 or 0, a client
present or absent. The method that carries the contributions (`audit_method`, registered for the run alone)
moves a flat model of --dim parameters by them. The federation is built by the experiment's own
`build_federation_and_budget` from the canaries' rows (its validation, the run's 128-bit secret from the
operating system, `private_algorithm`'s clipping, noise and accounting, and the secret, round keys and participant
draw it passes the `Federation`), and runs its rounds.

Modes (--modes):
- central: a fixed-size draw, the server averages the uploads as grouped FedAvg does and declares it (each
  group's mean shows who was drawn: no amplification, the client that joined most often composes its rounds);
  the auditor reads the released model after each round and the public draw.
- central_sampled: a fixed-size draw, a mean over all participants that hides the draw (amplified by the secret
  draw, as LG-FedAvg's head); the auditor reads the released models only.
- central_records: a fixed-size draw, the trusted server noises each upload on its own and releases them (a
  server that reads uploads one by one, as FedRE's head training); the auditor reads every noised record.
- local: a fixed-size draw, each client noises its own upload; the auditor is the server and reads every upload.
- poisson: Poisson sampling, a mean over all participants divided by the expected count (add/remove neighbours,
  the Poisson-subsampled Gaussian); the auditor reads the released models only.

The auditor scores each canary by the inner products of what it reads with the canary's direction (summed over
the rounds the canary joined where the draw is public, over every round where it is secret) and makes 2k guesses
(k fixed in advance: --guesses; the rest abstain): S_i = +1 for the k highest scores and -1 for the k lowest, or,
between present and absent canaries, "present" for the 2k highest (`guess`). If the run were (epsilon, delta)-DP
for the neighbours its accounting names, its number of correct guesses W could exceed a
Binomial(2k, e^eps / (1 + e^eps)) count only with the paper's small delta term; the largest epsilon whose p-value
for the observed W is below 1 - --confidence is the empirical lower bound. It is compared with the run's
`PrivacyBudget.epsilon` (what its rows and summary.json report); a lower bound above it shows a flaw in the
clipping, the noise, the keys, the draw or the accounting, and the script then exits with status 1. A one-run
bound is loose (each canary gives one bit): a check that the implementation is not grossly wrong, not an estimate
of the true epsilon. Writes benchmarks/results/dp_audit_cpu.json and .csv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from typing import NamedTuple, Optional
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from absl import flags

from harness import RESULTS, write_results

from fedjax_het.core import Algorithm, ClientProgram, Phase, UploadPrivacy, hyperparameter, single_stage
from fedjax_het.data.datasets import Dataset
from fedjax_het.data.federated import FederatedData
from fedjax_het.data.partition import ClientSplit, class_counts
from fedjax_het.methods.shared.base import local_head_evaluation
from fedjax_het.privacy import dp
from fedjax_het.run import experiment
from fedjax_het.run.cli import app_run
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.registry import METHODS, Method

AUDIT = 'dp_audit'
# mode -> (--dp_mode, --participation, the audit method's server, the neighbours its accounting names)
MODES = {'central': ('central', 'fixed', 'group_mean', 'replace-one'),
         'central_sampled': ('central', 'fixed', 'mean', 'replace-one'),
         'central_records': ('central', 'fixed', 'records', 'replace-one'),
         'local': ('local', 'fixed', 'records', 'replace-one'),
         'poisson': ('central', 'poisson', 'mean', 'add/remove')}
IMAGE = (1, 2, 1)  # a canary's row: pixel 0 its number, pixel 1 its bit

flags.DEFINE_list('modes', list(MODES), f'Modes to audit: {", ".join(MODES)}.')
flags.DEFINE_integer('canaries', 1024, 'm: canary clients, the whole federation.')
flags.DEFINE_integer('dim', 0, 'Parameters of the flat model the canaries move: a power of two, at least '
                     '--canaries (0: the smallest such).')
flags.DEFINE_list('noise_multipliers', ['2', '4'], 'sigma values to audit (each mode at each).')
flags.DEFINE_integer('rounds', 2, 'Rounds of the run (composed by the accounting).')
flags.DEFINE_float('join_ratio', 0.5, 'Clients drawn per round (a fixed-size draw), or each client\'s probability '
                   '(Poisson).')
flags.DEFINE_integer('guesses', 0, 'k: 2k guesses in all, k of each value where canaries are replaced (0: m / 10).')
flags.DEFINE_float('clip', 1.0, 'C.')
flags.DEFINE_float('canary_norm', 10.0, 'A canary\'s contribution before clipping, in units of C.')
flags.DEFINE_float('delta', 1e-5, 'delta of the accounted and the audited epsilon.')
flags.DEFINE_float('confidence', 0.95, 'Confidence of the lower bound.')
flags.DEFINE_integer('seed', 0, 'Seed of the canaries\' bits and of the run (--seed; the noise and a secret draw '
                     'come from the run\'s secret, as in any DP run).')
flags.DEFINE_float('noise_fraction', 1.0, 'Draw only this fraction of the accounted noise (a deliberately broken '
                   'run: below 1, the audit should find more than the accounted epsilon).')
flags.DEFINE_string('out', RESULTS, 'Folder for the JSON/CSV results.')
FLAGS = flags.FLAGS


# ------------------------------------------------------------------ the statistics of the one-run audit
def audit_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
  """P-value of v correct guesses of r among m canaries if the run were (eps, delta)-DP: the
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


# ------------------------------------------------------------------ the canaries' method
@dataclasses.dataclass(frozen=True)
class AuditConfig:
  """The canaries' method: each client moves a flat model by its canary's contribution."""
  dim: int = hyperparameter(1024, 'Parameters of the flat model (a power of two).', flag='dp_audit_dim')
  canary_norm: float = hyperparameter(10.0, 'Norm of a canary\'s contribution (before the DP layer clips it).',
                                      flag='dp_audit_canary_norm')
  server: str = hyperparameter('group_mean', '\'group_mean\' (grouped FedAvg), \'mean\' (over all participants, '
                               'hiding the draw) or \'records\' (every upload kept and released).',
                               flag='dp_audit_server')


class AuditModel(NamedTuple):
  """The broadcast and the upload: the flat model."""
  model: jnp.ndarray


class AuditServer(NamedTuple):
  """The released model, and for the 'records' server every upload of the last round by client (zeros where a
  client did not take part)."""
  model: jnp.ndarray
  records: Optional[jnp.ndarray] = None


def canary_direction(number, dim: int) -> jnp.ndarray:
  """The unit direction in `dim` parameters (a power of two) that canary `number` moves: row `number` of Sylvester's
  dim x dim Hadamard matrix over sqrt(dim), entries (-1)^popcount(number & j) / sqrt(dim). Dense (a clip of each
  coordinate would leave it near norm sqrt(dim) times too long), a function of the number alone (the auditor
  computes it too), and exactly orthogonal to every other canary's, so that no canary's score carries another's
  contribution: only the noise hides it."""
  bits = jnp.bitwise_and(jnp.asarray(number, jnp.int32), jnp.arange(dim, dtype=jnp.int32))
  parity = jax.lax.population_count(bits) % 2
  return (1 - 2 * parity).astype(jnp.float32) / math.sqrt(dim)


def canary_contribution(row: jnp.ndarray, cfg: AuditConfig) -> jnp.ndarray:
  """What a client's row adds to the model: its bit (pixel 1) times canary_norm times its number's direction."""
  flat = row.reshape(-1)
  return flat[1] * cfg.canary_norm * canary_direction(jnp.round(flat[0]).astype(jnp.int32), cfg.dim)


_PRIVACY = {'group_mean': UploadPrivacy(reference=lambda b: {'model': b.model}, aggregate='group_sum'),
            'mean': UploadPrivacy(reference=lambda b: {'model': b.model}, aggregate='sum', hides_participants=True),
            'records': UploadPrivacy(reference=lambda b: {'model': b.model}, aggregate='records')}


def audit_method(cfg: AuditConfig, num_classes: int) -> Algorithm:
  """Each participant uploads the model it received plus its canary's contribution (no local step: the program
  reads nothing of the classifier); the server averages the uploads ('group_mean' within the group, as grouped
  FedAvg; 'mean' over all participants) or keeps each ('records', the model their mean)."""
  if cfg.server not in _PRIVACY:
    raise ValueError(f'AuditConfig.server={cfg.server!r} must be one of {", ".join(_PRIVACY)}.')

  def client(group):
    def final(carry, rows, broadcast, key):
      return carry, AuditModel(broadcast.model + canary_contribution(rows.x[0], cfg))
    step = lambda c, batch, broadcast, key: (c, jnp.zeros((), jnp.float32))
    return ClientProgram(lambda c, broadcast, key: c, single_stage(step, group.training), final, group.training,
                         identity=('dp_audit canary', cfg))

  def init_server(key, spec, initial):
    records = jnp.zeros((spec.num_clients, cfg.dim), jnp.float32) if cfg.server == 'records' else None
    return AuditServer(jnp.zeros(cfg.dim, jnp.float32), records)

  def server_update(server, uploads, key):
    if cfg.server == 'group_mean':
      (model,) = uploads.group_mean('model', by='rows', previous=(server.model,))
      return server._replace(model=model), {}
    model = uploads.mean('model', previous=server.model)
    if cfg.server == 'mean':
      return server._replace(model=model), {}
    (u,) = uploads  # one group: its clients are the federation's, in order
    kept = jnp.where(u.mask[:, None], u.values.model, 0.0)
    return AuditServer(model, jnp.zeros_like(server.records).at[u.client].set(kept, mode='drop')), {}

  phase = Phase(AUDIT, client, server_update, broadcast=lambda server, group: AuditModel(server.model))
  return Algorithm(AUDIT, init_server, (phase,), local_head_evaluation, upload_privacy=_PRIVACY[cfg.server])


@contextlib.contextmanager
def registered():
  """The canaries' method in the registry while the run is built (a method added with one registry line,
  tests/test_adding_a_method.py), and out of it afterwards."""
  METHODS[AUDIT] = Method(AuditConfig, audit_method, 'the DP audit\'s canaries')
  try:
    yield
  finally:
    METHODS.pop(AUDIT, None)


def canary_data(bits: np.ndarray) -> FederatedData:
  """m clients, client k holding one training row: canary k's number and bit (pixel 1); a global test set of two
  blank rows (nothing is evaluated)."""
  m = len(bits)
  x = np.zeros((m,) + IMAGE, np.float32)
  x[:, 0, 0, 0], x[:, 0, 1, 0] = np.arange(m), bits
  y = (np.arange(m) % 2).astype(np.int32)
  dataset = Dataset('dp_audit canaries', x, y, 2, np.zeros((2,) + IMAGE, np.float32), np.array([0, 1], np.int32))
  train, test = [np.array([k], np.int64) for k in range(m)], [np.zeros(0, np.int64) for _ in range(m)]
  split = ClientSplit(train, test, class_counts(y, train, 2), class_counts(y, test, 2))
  return FederatedData(dataset, split, 'global')


def build(cfg: ExperimentConfig, data: FederatedData):
  """(Federation, PrivacyBudget) of `cfg` as the experiment builds them (`build_federation_and_budget`), over the
  canaries' rows in place of the loaded and partitioned dataset."""
  with mock.patch.object(experiment, 'load_dataset', lambda *args, **kwargs: data.dataset), \
       mock.patch.object(experiment, 'make_federated_data', lambda *args, **kwargs: data):
    return experiment.build_federation_and_budget(cfg)


@contextlib.contextmanager
def noise_scaled(fraction: float):
  """Every DP noise draw (`privacy.dp.gaussian_noise`) at `fraction` of its standard deviation, while the
  accounting keeps the full sigma: a deliberately broken run."""
  if fraction == 1:
    yield
    return
  draw = dp.gaussian_noise
  with mock.patch.object(dp, 'gaussian_noise', lambda tree, key, std: draw(tree, key, std * fraction)):
    yield


# ------------------------------------------------------------------ one audited run
@dataclasses.dataclass(frozen=True)
class Settings:
  """One audit's size and privacy settings (the flags of the same names); strategy: the executor ('vmap': the
  canaries of a round in vmapped chunks)."""
  canaries: int = 1024
  dim: int = 0  # 0: the smallest power of two >= canaries
  rounds: int = 2
  join_ratio: float = 0.5
  guesses: int = 0
  clip: float = 1.0
  canary_norm: float = 10.0
  delta: float = 1e-5
  confidence: float = 0.95
  seed: int = 0
  noise_fraction: float = 1.0
  strategy: str = 'vmap'


def audit(mode: str, sigma: float, s: Settings) -> dict:
  """One run of `mode` at noise multiplier `sigma` through the Federation, audited: its row."""
  dp_mode, participation, server, adjacency = MODES[mode]
  m = s.canaries
  dim = s.dim or 1 << (m - 1).bit_length()
  if dim < m or dim & (dim - 1):
    raise ValueError(f'Settings.dim={dim} must be a power of two of at least the {m} canaries (one orthogonal '
                     f'direction each).')
  rng = np.random.default_rng([s.seed, list(MODES).index(mode), int(sigma * 1000)])
  bits = rng.choice([1.0, -1.0] if adjacency == 'replace-one' else [1.0, 0.0], m)
  data = canary_data(bits)
  with registered():
    # the group's classifier (the golden run's smallest) is made for every client; the canaries' program never
    # reads it
    cfg = ExperimentConfig(algorithm=AUDIT, dataset='dp_audit canaries', num_clients=m,
                           models=('small_cnn_narrow',), feature_dim=16, rounds=s.rounds, batch_size=1,
                           join_ratio=s.join_ratio, participation=participation, eval_protocol='global',
                           seed=s.seed, checkpoint_every=0, strategy=s.strategy, dp_mode=dp_mode, dp_clip=s.clip,
                           dp_noise_multiplier=sigma, dp_delta=s.delta,
                           methods={AUDIT: AuditConfig(dim, s.canary_norm * s.clip, server)})
    with noise_scaled(s.noise_fraction):
      fed, budget = build(cfg, data)
      assert budget.sampled == (server == 'mean'), (mode, budget.describe())
      assert budget.describe()['adjacency'].startswith('add or remove' if adjacency == 'add/remove' else 'replace-one')
      scores = run_and_score(fed, budget, server, dim, m)
  correct, guesses = guess(scores, bits > 0, s.guesses or m // 10, adjacency)
  bound = audit_epsilon(m, guesses, correct, s.delta, s.confidence)
  accounted = budget.epsilon(s.rounds)
  return {'mode': mode, 'dp_mode': dp_mode, 'participation': participation, 'server': server,
          'adjacency': adjacency, 'amplified_by_sampling': budget.sampled, 'noise_multiplier': sigma,
          'canaries': m, 'dim': dim, 'rounds': s.rounds, 'join_ratio': s.join_ratio,
          'most_joins': None if budget.sampled else budget.participations(s.rounds),
          'guesses': guesses, 'correct': correct, 'audited_epsilon_lower_bound': bound,
          'accounted_epsilon': accounted, 'exceeds': bound > accounted, 'accountant': budget.accountant,
          'noise_fraction': s.noise_fraction, 'delta': s.delta, 'confidence': s.confidence}


def guess(scores: np.ndarray, positive: np.ndarray, k: int, adjacency: str) -> tuple[int, int]:
  """(correct guesses, guesses): replace-one, +1 for the k highest scores and -1 for the k lowest; add/remove,
  "present" for the 2k highest (an absent canary and a present one the secret draw left out both score about 0,
  so a low score is no evidence of absence); every other canary abstains."""
  order = np.argsort(scores, kind='stable')
  if adjacency == 'add/remove':
    return int(positive[order[-2 * k:]].sum()), 2 * k
  return int(positive[order[-k:]].sum() + (~positive[order[:k]]).sum()), 2 * k


def run_and_score(fed, budget, server: str, dim: int, m: int) -> np.ndarray:
  """Runs the federation's rounds and scores each canary (client k holds canary k) by what the auditor reads:
  the released model's change along the canary's direction, or (records) the canary's noised upload's, less the
  round's mean upload; summed over the rounds the canary joined where the draw is public (the accounting takes it
  as known), over every round where it is the run's secret."""
  assert len(fed.groups) == 1 and list(fed.groups[0].clients) == list(range(m)), 'one group of every canary'
  directions = np.asarray(jax.jit(jax.vmap(lambda c: canary_direction(c, dim)))(jnp.arange(m)))
  scores = np.zeros(m)
  state = fed.init()
  for r in range(fed.total_rounds):
    before = np.asarray(state.server.model)
    state, _ = fed.round(state)
    joined = None if budget.sampled else fed.participants(r)  # public where the accounting takes it so
    if server == 'records':  # less the round's mean upload: noise that clients share (a key reused) cancels
      uploads = np.asarray(state.server.records)[joined]
      scores[joined] += np.einsum('kd,kd->k', uploads - uploads.mean(0), directions[joined])
    else:
      along = directions @ (np.asarray(state.server.model) - before)
      if joined is None:
        scores += along
      else:
        scores[joined] += along[joined]
  return scores


def main(_):
  settings = Settings(canaries=FLAGS.canaries, dim=FLAGS.dim, rounds=FLAGS.rounds, join_ratio=FLAGS.join_ratio,
                      guesses=FLAGS.guesses, clip=FLAGS.clip, canary_norm=FLAGS.canary_norm, delta=FLAGS.delta,
                      confidence=FLAGS.confidence, seed=FLAGS.seed, noise_fraction=FLAGS.noise_fraction)
  unknown = [m for m in FLAGS.modes if m not in MODES]
  if unknown:
    raise SystemExit(f'--modes: unknown {", ".join(unknown)}; choose from {", ".join(MODES)}.')
  name = f'dp_audit_{jax.default_backend()}'
  rows = []
  print(f'{"mode":>16} {"sigma":>6} {"correct":>10} | {"audit eps >=":>12} {"accounted eps":>13}  neighbours')
  for mode in FLAGS.modes:
    for sigma in (float(v) for v in FLAGS.noise_multipliers):
      row = audit(mode, sigma, settings)
      rows.append(row)
      print(f'{mode:>16} {sigma:6.2f} {row["correct"]:5d}/{row["guesses"]:<4d} | '
            f'{row["audited_epsilon_lower_bound"]:12.3f} {row["accounted_epsilon"]:13.3f}  {row["adjacency"]}'
            f'{"  ABOVE THE ACCOUNTED EPSILON" if row["exceeds"] else ""}', flush=True)
      write_results(FLAGS.out, name, {'seed': FLAGS.seed}, rows, complete=False)
  write_results(FLAGS.out, name, {'seed': FLAGS.seed}, rows)
  if settings.noise_fraction == 1 and any(row['exceeds'] for row in rows):
    print('An empirical lower bound exceeds the accounted epsilon: the clipping, the noise, the keys, the draw or '
          'the accounting is wrong.', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  app_run(main)
