"""The (epsilon, delta) a DP run spends, with Google's dp-accounting, and the noise that meets a target epsilon.

Each round that uploads releases every participant's clipped contribution through the Gaussian mechanism
(`privacy.dp`). Under a fixed-size draw (n of the N clients a round) two neighbouring federations differ in one
client replaced by another: the contribution's L2 sensitivity is 2C against noise sigma * C, a Gaussian of noise
multiplier sigma / 2 in dp-accounting's terms.

- central, for a method whose releases hide who took part (`privacy.dp.claims_amplification`: LG-FedAvg, FML,
  FedMRL, FedMD, and FedRE with its label and weight private too): an observer of what the server releases does not
  know who was drawn, so each round is the Gaussian subsampled without replacement (n of N; Wang, Balle &
  Kasiviswanathan 2019), composed over the rounds with the RDP accountant (dp-accounting accounts sampling without
  replacement only with RDP). A round in which every client joins is the plain Gaussian.
- local, and central for every other method (a per-group or per-class mean shows who was drawn): nothing is gained
  from sampling: a client's uploads compose over the rounds it joins (the most of any client, known from the
  seeded draw), T Gaussians of multiplier s being one of multiplier s / sqrt(T). RDP or PLD.
- central under Poisson sampling (`--participation=poisson`: each client joins with probability q), for a method
  whose server reads the private parts only through means over all participants, divided by the expected count qN
  (`privacy.dp`'s fixed denominator): neighbouring federations differ in one client added or removed, the
  sensitivity of the sum is C, and each round is dp-accounting's Poisson-subsampled Gaussian of multiplier sigma
  (RDP or PLD; a round at q = 1 the plain Gaussian), as DP-FedAvg (McMahan et al. 2018) accounts it. Other methods
  under Poisson sampling count as in the item above (the draw is public, the neighbours replace one client's data).

Epsilon is a function of the round count, which a checkpoint holds, so a resumed run reports what an uninterrupted
one does. Every round of a run counts, including one whose phase uploads nothing private (an upper bound).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Callable, Optional

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from fedjax_het.engine.schedule import Schedule
from fedjax_het.errors import ConfigError

ACCOUNTANTS = ('rdp', 'pld')


class _NoConvergenceLines(logging.Filter):
  """dp-accounting's series for the Poisson-subsampled Gaussian at fractional RDP orders may not converge at small
  orders with much noise; it then leaves that order out (the bound stays valid, over the other orders) and logs a
  line per order and call, hundreds in a calibration, which this keeps out of a run's log."""

  def filter(self, record: logging.LogRecord) -> bool:
    return 'failed to converge' not in record.getMessage()


logging.getLogger('absl').addFilter(_NoConvergenceLines())
_REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def round_event(num_clients: int, draw: float, noise_multiplier: float, poisson: bool = False
                ) -> dp_accounting.DpEvent:
  """One central round amplified by its draw: under a fixed-size draw, the Gaussian of multiplier sigma / 2
  (replace-one sensitivity 2C) on a sample of `draw` of `num_clients` clients drawn without replacement; under
  Poisson sampling, the Gaussian of multiplier sigma (add/remove sensitivity C) on a sample taking each client with
  probability `draw`. The plain Gaussian when every client joins."""
  if poisson:
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    return gaussian if draw >= 1 else dp_accounting.PoissonSampledDpEvent(draw, gaussian)
  gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
  if draw >= num_clients:
    return gaussian
  return dp_accounting.SampledWithoutReplacementDpEvent(num_clients, int(draw), gaussian)


def unsampled_event(participations: int, noise_multiplier: float) -> dp_accounting.DpEvent:
  """`participations` releases of a client's contribution with nothing gained from sampling (local mode; central
  rounds that every client joins, or whose releases show who took part): Gaussians of multiplier sigma / 2,
  composed exactly as one of multiplier sigma / (2 sqrt(participations))."""
  if participations == 0:
    return dp_accounting.NoOpDpEvent()
  return dp_accounting.GaussianDpEvent(noise_multiplier / (2 * math.sqrt(participations)))


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
  """The privacy a run of `schedule` spends: mode 'central' or 'local', sigma, delta, the accountant, and whether
  the method's releases hide who took part (`UploadPrivacy.hides_participants`: central rounds amplified by the
  draw)."""
  schedule: Schedule
  mode: str
  noise_multiplier: float
  delta: float
  accountant: str = 'rdp'
  hides_participants: bool = True
  allow_large_delta: bool = False
  public_parts: tuple[str, ...] = ()  # upload parts released without noise (what the epsilon does not cover)
  noise_source: str = 'secret'  # 'secret' (the OS's entropy) or 'seed' (--dp_reproducible_noise)

  def __post_init__(self):
    if self.mode not in ('central', 'local'):
      raise ConfigError(f'PrivacyBudget.mode={self.mode!r} must be \'central\' or \'local\'.')
    if self.accountant not in ACCOUNTANTS:
      raise ConfigError(f'PrivacyBudget.accountant={self.accountant!r} must be one of {", ".join(ACCOUNTANTS)}.')
    if not 0 < self.delta < 1:
      raise ConfigError(f'PrivacyBudget.delta={self.delta} must be in (0, 1); a common choice is below 1 / clients '
                        f'({1 / self.schedule.num_clients:.3g} here).')
    if self.delta >= 1 / self.schedule.num_clients and not self.allow_large_delta:
      raise ConfigError(f'PrivacyBudget.delta={self.delta:g} is at least 1 / clients '
                        f'({1 / self.schedule.num_clients:.3g} here): a mechanism that publishes one client\'s data '
                        f'outright meets such a delta. Fix: a delta below {1 / self.schedule.num_clients:.3g} (1e-5 is '
                        f'the usual choice), or PrivacyBudget.allow_large_delta=True to report it anyway.')
    if self.sampled and not self.schedule.poisson and self.accountant == 'pld' and any(
        n < self.schedule.num_clients for n, _ in self.draws(self.schedule.total_rounds)):
      raise ConfigError('PrivacyBudget.accountant=\'pld\': dp-accounting\'s PLD accountant bounds Poisson sampling '
                        'only, and this run draws a fixed number of clients per round (--join_ratio < 1), which '
                        'its RDP accountant bounds. Fix: PrivacyBudget.accountant=\'rdp\', Poisson sampling '
                        '(--participation=poisson), or full participation (--join_ratio=1).')

  def event(self, rounds: int) -> dp_accounting.DpEvent:
    """What the first `rounds` rounds release about one client (dp-accounting's event); the rounds in which every
    client joins compose exactly into one Gaussian."""
    if not self.sampled:
      return unsampled_event(self.participations(rounds), self.noise_multiplier)
    if self.schedule.poisson:
      events = [dp_accounting.SelfComposedDpEvent(round_event(self.schedule.num_clients, q, self.noise_multiplier,
                                                              poisson=True), k) for q, k in self.draws(rounds)]
      return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)
    draws = self.draws(rounds)
    everyone = sum(k for n, k in draws if n >= self.schedule.num_clients)
    events = [dp_accounting.SelfComposedDpEvent(round_event(self.schedule.num_clients, n, self.noise_multiplier), k)
              for n, k in draws if n < self.schedule.num_clients]
    if everyone:
      events.append(unsampled_event(everyone, self.noise_multiplier))
    return events[0] if len(events) == 1 else dp_accounting.ComposedDpEvent(events)

  @property
  def sampled(self) -> bool:
    """Whether rounds count as Gaussians on a random sample (central mode, participants hidden)."""
    return self.mode == 'central' and self.hides_participants

  @property
  def hides_count(self) -> bool:
    """Whether the accounting counts on a Poisson draw, whose size (how many clients joined) must then stay as
    secret as the draw itself."""
    return self.sampled and self.schedule.poisson

  def draws(self, rounds: int) -> list[tuple[float, int]]:
    """(draw, rounds) of each stretch of the first `rounds` rounds with one draw: the number of clients drawn, or
    under Poisson sampling the rate (`Schedule.rate`); the rounds already run as they ran (`Schedule.joined`,
    `Schedule.rates_ran`), then stretches cut where a phase starts and where the full-participation rounds begin
    (a few stretches however long the run)."""
    schedule = self.schedule
    ran_draws = schedule.rates_ran if schedule.poisson else schedule.joined
    draw = schedule.rate if schedule.poisson else schedule.num_join
    ran = len(ran_draws[:rounds])
    full = schedule.total_rounds - schedule.full_participation_rounds
    cuts = sorted({ran, max(rounds, ran), *(c for c in (*schedule.phase_starts, full) if ran < c < rounds)})
    stretches = [(n, 1) for n in ran_draws[:ran]]
    stretches += [(draw(start), end - start) for start, end in zip(cuts, cuts[1:])]
    runs: list[list] = []
    for n, k in stretches:
      if runs and runs[-1][0] == n:
        runs[-1][1] += k
      elif k:
        runs.append([n, k])
    return [(n, k) for n, k in runs]

  def participations(self, rounds: int) -> int:
    """The most rounds any one client joins among the first `rounds` (the seeded draw of `Schedule`), drawn as far
    as asked and kept (a run's epsilon after round r draws r rounds, not the run's whole length)."""
    joins = self._joins
    while len(joins['most']) <= rounds:
      joins['counts'][self.schedule.participants(len(joins['most']) - 1)] += 1
      joins['most'].append(int(joins['counts'].max()))
    return joins['most'][rounds]

  def with_noise(self, noise_multiplier: float) -> 'PrivacyBudget':
    """This budget at another sigma, sharing the draws made so far and those made later (`participations`), which
    do not depend on the noise: a calibration draws the run's participants once, not once per sigma it tries."""
    other = dataclasses.replace(self, noise_multiplier=float(noise_multiplier))
    other.__dict__['_joins'] = self._joins  # the cached_property's slot
    return other

  @functools.cached_property
  def _joins(self) -> dict:
    """The draws so far: each client's joins ('counts') and the most joins after each round ('most')."""
    return {'counts': np.zeros(self.schedule.num_clients, int), 'most': [0]}

  def epsilon(self, rounds: int) -> float:
    """Epsilon at `delta` after the first `rounds` rounds. For rounds amplified by the draw, the subsampled
    Gaussian's composition alone: a bound that does not depend on which clients the secret draw took. (The
    composition over the client that joined most often, `realised_epsilon`, also bounds the run and is sometimes
    smaller, but choosing it, printing it each round and calibrating on it would release how often the most
    frequent client was drawn, which the amplification assumes hidden.)"""
    if rounds == 0:
      return 0.0
    if not self.sampled:
      return self._epsilon(self.event(rounds), replace_one=False)
    poisson = self.schedule.poisson
    if self.accountant == 'rdp':  # fast: one RDP curve per draw, summed
      curve = sum(k * _round_rdp(self.schedule.num_clients, n, self.noise_multiplier, poisson)
                  for n, k in self.draws(rounds))
      amplified = float(rdp.rdp_privacy_accountant.compute_epsilon(rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS,
                                                                   curve, self.delta)[0])
    else:
      amplified = self._epsilon(self.event(rounds), replace_one=not poisson)
    return amplified

  def realised_epsilon(self, rounds: int) -> float:
    """Epsilon after the first `rounds` rounds counting nothing for the sampling: the client that joined most often
    of this run's draw composes the rounds it joined."""
    return self._epsilon(unsampled_event(self.participations(rounds), self.noise_multiplier), replace_one=False)

  def _epsilon(self, event: dp_accounting.DpEvent, replace_one: bool) -> float:
    if isinstance(event, dp_accounting.NoOpDpEvent):
      return 0.0
    if self.accountant == 'pld' and isinstance(event, dp_accounting.GaussianDpEvent):
      return gaussian_epsilon(event.noise_multiplier, self.delta)
    acc = make_accountant(self.accountant, replace_one)
    acc.compose(event)
    return float(acc.get_epsilon(self.delta))

  def after(self, rows: list[dict]) -> 'PrivacyBudget':
    """This budget for a run whose first rounds wrote metrics `rows` (a resumed run's): epsilon accounts the rounds
    that ran as they ran (their participants, or under Poisson sampling their rate), not as the run's present
    settings would draw them."""
    if self.schedule.poisson:
      ran = {'rates_ran': tuple(float(r['sampling_rate']) for r in rows)}
    else:
      # the clients drawn, not those that answered (a Flower row's `drawn`): the draw of n of N is seeded by n
      ran = {'joined': tuple(int(r.get('drawn', r['participants'])) for r in rows)}
    return dataclasses.replace(self, schedule=dataclasses.replace(self.schedule, **ran))

  def describe(self) -> dict:
    """What the reported epsilon means: the neighbouring relation, how participants are drawn, whether the draw
    amplifies (central rounds of a method whose releases hide who took part), the accountant, and the upload parts it
    does not cover (public, released without noise: the guarantee holds between federations that agree on them)."""
    poisson = self.schedule.poisson
    return {'adjacency': ('add or remove one client (all of its data)' if self.hides_count
                          else 'replace-one client (all of its data)'),
            'sampling': ('Poisson: each client joins each round independently with probability --join_ratio' if poisson
                         else 'fixed-size draw without replacement'),
            'amplified_by_sampling': self.sampled, 'accountant': self.accountant,
            'public_parts': list(self.public_parts),
            'noise_source': ('the run\'s seed (--dp_reproducible_noise): anyone who knows --seed can regenerate the '
                             'noise and the draw, which voids the guarantee against them' if self.noise_source == 'seed'
                             else 'secret: the operating system\'s entropy, drawn by each process (each node)'),
            'holds_for': ('federations that differ in one client\'s data and agree on the public parts'
                          if self.public_parts else 'federations that differ in one client\'s data')}

  def metrics(self, rounds: int) -> dict:
    """A round's row entries: dp_epsilon, spent at dp_delta after `rounds` rounds, and the noise multiplier."""
    return {'dp_epsilon': self.epsilon(rounds), 'dp_delta': self.delta, 'dp_noise_multiplier': self.noise_multiplier}


def make_accountant(accountant: str, replace_one: bool) -> dp_accounting.PrivacyAccountant:
  """A fresh dp-accounting accountant ('rdp' or 'pld'); replace-one neighbours where sampling without replacement
  needs them (RDP)."""
  if accountant == 'pld':
    return pld.PLDAccountant()
  return rdp.RdpAccountant(neighboring_relation=_REPLACE_ONE) if replace_one else rdp.RdpAccountant()


@functools.lru_cache(maxsize=4096)
def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
  """The exact epsilon of one Gaussian mechanism at `delta` (dp-accounting's analytic formula, which its PLD
  accountant approximates on a grid: the PLD figure for a run that composes only Gaussians)."""
  return float(dp_accounting.get_epsilon_gaussian(noise_multiplier, delta))


@functools.lru_cache(maxsize=64)
def _round_rdp(num_clients: int, draw: float, noise_multiplier: float, poisson: bool = False) -> np.ndarray:
  """The RDP curve (at dp-accounting's default orders) of one central round (`round_event`); RDP composes by adding
  curves."""
  acc = make_accountant('rdp', replace_one=not poisson)
  acc.compose(round_event(num_clients, draw, noise_multiplier, poisson))
  return np.asarray(acc._rdp)  # dp-accounting keeps the curve it composes; tests check the sum against it


# The most rounds --dp_target_epsilon calibrates over. Calibration draws every round's participants where it counts
# the client that joins most often (about 15 us a round with 20 clients, 150 us with 50,000) and, for Poisson rounds
# under the PLD accountant, composes them all at each sigma it tries (seconds at this count, a 30 GiB grid at 1e8):
# beyond it a run would sit silent for minutes to hours before its first round. --dp_noise_multiplier has no bound.
MAX_CALIBRATED_ROUNDS = 100_000
_DRAWN_PER_CHECK = 5000  # rounds drawn between two calls of a calibration's `check`


def check_calibration_rounds(rounds: int, target_epsilon: float) -> None:
  """Refuses to calibrate sigma over more than MAX_CALIBRATED_ROUNDS rounds (a ConfigError naming the flags)."""
  if rounds > MAX_CALIBRATED_ROUNDS:
    raise ConfigError(f'--dp_target_epsilon={target_epsilon:g} with --rounds={rounds}: calibrating the noise to a '
                      f'target draws every round\'s participants or composes every round, which beyond '
                      f'{MAX_CALIBRATED_ROUNDS:,} rounds takes minutes to hours before the first round. Fix: set the '
                      f'noise with --dp_noise_multiplier instead (epsilon is then reported round by round), or at most '
                      f'--rounds={MAX_CALIBRATED_ROUNDS}.')


def calibrate(budget: PrivacyBudget, target_epsilon: float, check: Callable[[], None] = lambda: None) -> float:
  """The noise multiplier sigma for which `budget`'s whole run spends `target_epsilon` at its delta: for rounds
  amplified by the draw, a search on the epsilon it reports (the subsampled Gaussian's, `epsilon`, `_search_sigma`);
  otherwise dp-accounting's `calibrate_dp_mechanism` (a bisection) over its RDP accountant, or, for a run that
  composes only Gaussians under the PLD accountant, its exact `get_sigma_gaussian` for the one Gaussian they
  compose into. At most MAX_CALIBRATED_ROUNDS rounds (`check_calibration_rounds`); the run's participants are
  drawn once, not once per sigma tried (`with_noise`). `check` is called between steps (every few thousand rounds
  drawn, every sigma tried): a caller stops the calibration by raising from it (a stop signal)."""
  if not (math.isfinite(target_epsilon) and target_epsilon > 0):
    raise ConfigError(f'--dp_target_epsilon={target_epsilon} must be a positive number.')
  rounds = budget.schedule.total_rounds
  if rounds == 0:
    raise ConfigError(f'--dp_target_epsilon={target_epsilon:g}: the run has no rounds, so there is no noise to '
                      f'calibrate. Fix: --rounds > 0.')
  check_calibration_rounds(rounds, target_epsilon)
  start = budget.with_noise(1.0)  # the run at sigma = 1; every sigma tried shares its draws
  if not budget.sampled:  # the most joins of any client, drawn once, a few thousand rounds at a time
    for drawn in range(0, rounds, _DRAWN_PER_CHECK):
      check()
      start.participations(min(drawn + _DRAWN_PER_CHECK, rounds))
  check()
  unit = start.event(rounds)
  if isinstance(unit, dp_accounting.NoOpDpEvent):
    raise ConfigError('--dp_target_epsilon: no client uploads in this run, so no noise is needed.')

  def at(sigma: float) -> PrivacyBudget:
    check()
    return start.with_noise(sigma)
  try:
    if budget.sampled:
      sigma = _search_sigma(start, target_epsilon, rounds, at)
    elif budget.accountant == 'pld' and isinstance(unit, dp_accounting.GaussianDpEvent):
      sigma = float(dp_accounting.get_sigma_gaussian(target_epsilon, budget.delta) / unit.noise_multiplier)
    else:
      make_event = lambda sigma: at(float(sigma)).event(rounds)
      sigma = float(dp_accounting.calibrate_dp_mechanism(
          lambda: make_accountant('rdp', budget.sampled), make_event, target_epsilon, budget.delta,
          dp_accounting.LowerEndpointAndGuess(1e-2, 1.0), tol=1e-4))
  except (ValueError, ArithmeticError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError):
    sigma = float('nan')
  if not (math.isfinite(sigma) and sigma > 0):
    raise ConfigError(f'--dp_target_epsilon={target_epsilon:g}: the accountant finds no noise multiplier for it '
                      f'over this run ({rounds} rounds, delta {budget.delta:g}): so large an epsilon promises no '
                      f'privacy a DP review would accept. Fix: a target epsilon of at most a few tens, or set '
                      f'--dp_noise_multiplier instead.')
  return sigma


def _search_sigma(budget: PrivacyBudget, target_epsilon: float, rounds: int,
                  at: Optional[Callable[[float], PrivacyBudget]] = None, tol: float = 1e-4) -> float:
  """The smallest sigma (to `tol`, relative) at which `budget.epsilon(rounds)` is at most `target_epsilon` (it falls
  as sigma grows): a bracket by doubling or halving from 1, then that bracket narrowed in log-space to a ratio of
  at most 1 + tol (`_narrow_bracket`). NaN where no sigma in [0.01, 1e6] is the answer (the target is beyond what
  0.01 spends, or below what 1e6 does), as dp-accounting's calibration from the same lower end. `at(sigma)`: the
  budget at sigma (default `with_noise`)."""
  at = at or budget.with_noise
  spent = {}

  def spend(sigma: float) -> float:
    if sigma not in spent:
      spent[sigma] = at(sigma).epsilon(rounds)
    return spent[sigma]
  low, high = 1.0, 1.0
  while spend(high) > target_epsilon:
    low, high = high, high * 2
    if high > 1e6:
      return float('nan')
  while spend(low) <= target_epsilon:
    if low <= 1e-2:
      return float('nan')
    low, high = max(low / 2, 1e-2), low
  return _narrow_bracket(spend, target_epsilon, low, high, tol)


def _narrow_bracket(spend: Callable[[float], float], target: float, low: float, high: float, tol: float) -> float:
  """`high` of a bracket low < high, spend(low) > target >= spend(high) for a falling `spend`, narrowed until
  high / low <= 1 + tol. Each step tries where the line through the ends in (log sigma, log epsilon) crosses the
  target (the Illinois variant of regula falsi: an end kept twice in a row has its value halved, so both ends move),
  kept a quarter of the tolerance inside the bracket, so that a guess next to the answer closes the bracket from
  both sides; bisection where the logarithms are not finite. An RDP epsilon is close to a power of sigma: on the
  tests' curves it takes at most 8 evaluations from a bracket of ratio 2 where bisection takes 15, each of them a
  composition by dp-accounting. An epsilon of NaN raises ArithmeticError (`calibrate` then finds no sigma)."""
  def gap(epsilon: float) -> float:  # log(epsilon / target): > 0 where sigma is too small
    if math.isnan(epsilon):
      raise ArithmeticError('the accountant gave epsilon NaN')
    return math.log(epsilon / target) if 0 < epsilon < math.inf else math.copysign(math.inf, epsilon - target)
  f_low, f_high = gap(spend(low)), gap(spend(high))
  kept = 0  # +1: the low end was kept by the last step, -1: the high end
  margin = math.log1p(tol) / 4
  while high / low > 1 + tol:
    u_low, u_high = math.log(low), math.log(high)
    if math.isfinite(f_low) and math.isfinite(f_high) and f_low != f_high:
      u = u_high - f_high * (u_high - u_low) / (f_high - f_low)
    else:
      u = (u_low + u_high) / 2
    u = min(max(u, u_low + margin), u_high - margin)
    sigma = math.exp(u)
    f = gap(spend(sigma))
    if f > 0:
      low, f_low = sigma, f
      if kept == -1:
        f_high /= 2
      kept = -1
    else:
      high, f_high = sigma, f
      if kept == 1:
        f_low /= 2
      kept = 1
  return high
