"""What a DP run keeps secret and what it releases (docs/privacy.md): the secret behind the noise, the workdir's
`.dp_secret` on resume, and rows, logs and Flower messages that carry nothing the accounting assumes hidden."""

import dataclasses

import jax
import numpy as np
import pytest

from fedjax_het.privacy.dp import gaussian_noise
from fedjax_het.run import experiment

from golden import make_golden_federation
from runs import CFG


# ---------------------------------------------------------------- 1. the secret behind the noise
def test_the_noise_depends_on_every_bit_of_a_128_bit_secret(monkeypatch):
  """Two secrets equal in their low 64 bits (and in their low 96) give other round keys and other noise, for the
  clients and for the server; a run's secret is 128 bits of the OS's entropy; without a secret the keys are the
  seed's as before (the golden runs)."""
  fed = make_golden_federation('fedavg')
  seeded = [np.asarray(k) for k in fed.round_keys(2)]
  noise = lambda key: np.asarray(gaussian_noise(np.zeros(16, np.float32), jax.random.fold_in(key, 0), 1.0))
  for low, shift in ((0x0123_4567, 40), (0x0123456789ABCDEF_FEDCBA98, 100)):  # equal low 32 / low 96 bits
    keys = {}
    for high in (1, 2):
      fed.secret = low | (high << shift)
      keys[high] = [np.asarray(k) for k in fed.round_keys(2)]
    for a, b in zip(keys[1], keys[2]):  # the clients' key, the server's key
      assert not np.array_equal(a, b), hex(low)
      assert not np.allclose(noise(a), noise(b))
  fed.secret = None
  assert all(np.array_equal(a, b) for a, b in zip(seeded, fed.round_keys(2)))
  asked = []
  monkeypatch.setattr(experiment.secrets, 'randbits', lambda bits: asked.append(bits) or 7)
  experiment.dp_secret(dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=1.0))
  assert asked == [128]
