"""Which phase each round belongs to and which clients train in it: a run's schedule, known before any client is
built (the DP layer calibrates its noise to it, `fedjax_het.privacy.budget`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from fedjax_het.core import Phase
from fedjax_het.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The rounds of a run of `phases`: rounds, the run's --rounds (phases of open length take the rounds left);
  join_ratio, the share of clients in each round (a phase may set its own); full_participation_rounds, the run's
  last rounds in which every client joins; seed, the run's seed (participants are drawn from it); joined, the
  number of participants of each round already run, where they differ from what these settings give (a resumed
  run whose --rounds moved its full-participation rounds: the rounds that ran keep the draws they had)."""
  name: str
  phases: Sequence[Phase]
  num_clients: int
  rounds: int = 0
  join_ratio: float = 1.0
  full_participation_rounds: int = 0
  seed: int = 0
  joined: tuple[int, ...] = ()

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

  def num_join(self, round_index: int = 0) -> int:
    """Participants in round `round_index`: every client in the run's last `full_participation_rounds` rounds,
    else the phase's (or the run's) join ratio of them, at least one; for a round already run, as it ran (`joined`)."""
    if round_index < len(self.joined):
      return self.joined[round_index]
    if round_index >= self.total_rounds - self.full_participation_rounds:
      return self.num_clients
    ratio = self.phases[self.phase_index(round_index)].join_ratio or self.join_ratio
    return max(1, int(self.num_clients * ratio + 1e-9))

  def participants(self, round_index: int) -> np.ndarray:
    """Ascending ids of the clients that train in `round_index` (num_join of them, drawn without replacement)."""
    num_join = self.num_join(round_index)
    if num_join == self.num_clients:
      return np.arange(self.num_clients)
    rng = np.random.default_rng([self.seed, round_index, 0x5A])
    return np.sort(rng.choice(self.num_clients, num_join, replace=False))
