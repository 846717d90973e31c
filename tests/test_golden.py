"""No number moves: every method's metrics and final client parameters after two rounds on the tiny two-group
federation (half the clients per round) equal those pinned in fixtures/engine_golden.json. The fixture was
written by fixtures/make_engine_golden.py before the engine's version-2 refactor; regenerating it is a statement
that numbers move on purpose."""

import json
import os

import numpy as np
import pytest

from golden import METHODS, golden_run

with open(os.path.join(os.path.dirname(__file__), 'fixtures', 'engine_golden.json')) as f:
  GOLDEN = json.load(f)


@pytest.mark.parametrize('name', METHODS)
def test_metrics_and_parameters_equal_the_golden_run(tiny_data, name):
  got, want = golden_run(name, data=tiny_data), GOLDEN[name]
  assert got['eval_head'] == want['eval_head']
  np.testing.assert_allclose(got['client_params'], want['client_params'], rtol=2e-5)
  np.testing.assert_allclose(got['client_accuracy'], want['client_accuracy'], atol=1e-9)
  for r, (g, w) in enumerate(zip(got['rounds'], want['rounds'])):
    assert sorted(g) == sorted(w), f'round {r + 1}: metric names differ'
    for k in w:
      np.testing.assert_allclose(g[k], w[k], rtol=2e-5, atol=1e-7, err_msg=f'{name} round {r + 1} {k}')
