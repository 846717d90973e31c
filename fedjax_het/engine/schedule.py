"""Which phase each round belongs to and which clients train in it: a run's schedule, known before any client is
built (the DP layer calibrates its noise to it, `fedjax_het.privacy.budget`).

Two ways to draw a round's participants (`PARTICIPATION`): 'fixed', a fixed number n = max(1, floor(q N)) of the N
clients without replacement (HtFLlib's and the papers' protocol); 'poisson', each client independently with
probability q (the draw DP-FedAvg, McMahan et al. 2018, and the DP literature account), so a round may draw any
number of clients, none included.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fedjax_het.core import Phase
from fedjax_het.errors import ConfigError

PARTICIPATION = ('fixed', 'poisson')


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The rounds of a run of `phases`: rounds, the run's --rounds (phases of open length take the rounds left);
  join_ratio, the share of clients in each round (a phase may set its own); full_participation_rounds, the run's
  last rounds in which every client joins; seed, the run's seed (participants are drawn from it); joined, the
  number of participants of each round already run, where they differ from what these settings give (a resumed
  run whose --rounds moved its full-participation rounds: the rounds that ran keep the draws they had);
  participation, 'fixed' or 'poisson' (the module docstring); rates_ran, under Poisson sampling the probability of
  each round already run, as `joined` for a fixed-size draw."""
  name: str
  phases: Sequence[Phase]
  num_clients: int
  rounds: int = 0
  join_ratio: float = 1.0
  full_participation_rounds: int = 0
  seed: int = 0
  joined: tuple[int, ...] = ()
  participation: str = 'fixed'
  rates_ran: tuple[float, ...] = ()

  def __post_init__(self):
    if self.participation not in PARTICIPATION:
      raise ConfigError(f'--participation={self.participation!r} must be one of {", ".join(PARTICIPATION)}.')

  @property
  def poisson(self) -> bool:
    """Whether each client joins each round independently (Poisson sampling)."""
    return self.participation == 'poisson'

  @property
  def phase_starts(self) -> list[int]:
    """The first round (0-based) of each phase."""
    starts, at = [], 0
    for i, phase in enumerate(self.phases):
      starts.append(at)
      if phase.rounds is None and i < len(self.phases) - 1:
        raise ConfigError(f'{self.name}: phase {phase.name!r} has no length but is followed by others.')
      at += phase.rounds or 0
    return starts

  @property
  def total_rounds(self) -> int:
    """The run's length: --rounds when the last phase is open, else where the last fixed phase ends."""
    last = self.phases[-1]
    return self.rounds if last.rounds is None else self.phase_starts[-1] + last.rounds

  def phase_index(self, round_index: int) -> int:
    """The phase that round `round_index` (0-based) belongs to."""
    return max(i for i, s in enumerate(self.phase_starts) if s <= round_index)

  def rate(self, round_index: int = 0) -> float:
    """The share of clients round `round_index` asks for: 1 in the run's last `full_participation_rounds` rounds,
    else the phase's (or the run's) join ratio; for a Poisson round already run, as it ran (`rates_ran`). Under
    Poisson sampling each client's probability of joining."""
    if self.poisson and round_index < len(self.rates_ran):
      return self.rates_ran[round_index]
    if round_index >= self.total_rounds - self.full_participation_rounds:
      return 1.0
    return self.phases[self.phase_index(round_index)].join_ratio or self.join_ratio

  def expected_count(self, round_index: int = 0) -> float:
    """The number of participants round `round_index` draws on average: rate x clients under Poisson sampling, the
    fixed count otherwise."""
    return self.rate(round_index) * self.num_clients if self.poisson else float(self.num_join(round_index))

  def num_join(self, round_index: int = 0) -> int:
    """Participants in round `round_index`: every client in the run's last `full_participation_rounds` rounds,
    else the phase's (or the run's) join ratio of them, at least one; for a round already run, as it ran (`joined`).
    Under Poisson sampling, the size of the round's draw."""
    if self.poisson:
      return len(self.participants(round_index))
    if round_index < len(self.joined):
      return self.joined[round_index]
    return max(1, int(self.num_clients * self.rate(round_index) + 1e-9))

  def participants(self, round_index: int) -> np.ndarray:
    """Ascending ids of the clients that train in `round_index`: num_join of them drawn without replacement, or,
    under Poisson sampling, each client with probability `rate` (every client at rate 1)."""
    if self.poisson:
      rate = self.rate(round_index)
      if rate >= 1:
        return np.arange(self.num_clients)
      draw = np.random.default_rng([self.seed, round_index, 0x5A, 0x9015]).random(self.num_clients)
      return np.flatnonzero(draw < rate)
    num_join = self.num_join(round_index)
    if num_join == self.num_clients:
      return np.arange(self.num_clients)
    rng = np.random.default_rng([self.seed, round_index, 0x5A])
    return np.sort(rng.choice(self.num_clients, num_join, replace=False))
