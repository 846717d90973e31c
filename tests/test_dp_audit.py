"""benchmarks/dp_audit.py at its tiniest size, through the Federation as the experiment builds it (its secret,
`private_algorithm`, the round keys and the draw): the one-run lower bound on epsilon stays at or below the epsilon
the library accounts for the run, and a run whose noise is broken (a hundredth of its standard deviation drawn,
the accounting unchanged) is caught, its bound above the accounted epsilon."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'benchmarks'))
from dp_audit import Settings, audit  # noqa: E402

from fedjax_het.privacy import dp  # noqa: E402

# 1,024 canaries (each in one orthogonal direction of 1,024 parameters), one round, half of them drawn, 200
# guesses. All right, they bound epsilon at 4.17; an honest run gets about 60 % right (a bound below 0.3), and
# exceeding the accounted epsilon takes 158 (central, local) or 153 (Poisson) right, about five standard
# deviations above it. The sequential executor (CPU's default): here the vmap executor's compilations cost more
# than the rounds they run.
TINY = Settings(canaries=1024, rounds=1, join_ratio=0.5, guesses=100, strategy='sequential')
# sigma at which each mode accounts about epsilon 1 here (replace-one 1.01; Poisson, add/remove, 0.88)
SIGMA = {'central': 8.0, 'local': 8.0, 'poisson': 3.0}


@pytest.mark.parametrize('mode', [m if m == 'central' else pytest.param(m, marks=pytest.mark.slow) for m in sorted(SIGMA)])
def test_the_audit_stays_below_the_accounted_epsilon_and_catches_a_broken_noise(mode, monkeypatch):
  honest = audit(mode, SIGMA[mode], TINY)
  assert honest['guesses'] == 200
  assert honest['audited_epsilon_lower_bound'] <= honest['accounted_epsilon'], honest

  draw = dp.gaussian_noise
  monkeypatch.setattr(dp, 'gaussian_noise', lambda tree, key, std: draw(tree, key, std * 0.01))
  broken = audit(mode, SIGMA[mode], TINY)
  assert broken['accounted_epsilon'] == honest['accounted_epsilon']
  assert broken['audited_epsilon_lower_bound'] > broken['accounted_epsilon'], broken
