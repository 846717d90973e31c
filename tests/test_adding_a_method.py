"""Adding a method is its module plus one registry line (DEVELOPERS.md): a method written here, registered with one
`METHODS` entry, gets its command-line flag, runs under both executors through the experiment's path, and takes
exactly the steps its config asks for."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from fedjax_het.core import Algorithm, Phase, hyperparameter
from fedjax_het.methods.shared.base import keep_server, local_head_evaluation, no_server, sgd_program
from fedjax_het.methods.shared.common import cross_entropy, train_forward
from fedjax_het.run import cli
from fedjax_het.run.registry import METHODS, Method
from runs import CFG, record_rounds


# ------------------------------------------------------------------ the method's module
@dataclasses.dataclass(frozen=True)
class ShrinkConfig:
  """A toy method: local SGD on CE plus an L2 pull of the parameters towards 0."""
  shrink: float = hyperparameter(0.5, 'Shrink: weight of the L2 term.', flag='shrink_weight')


def shrink(cfg: ShrinkConfig, num_classes: int) -> Algorithm:
  """CE + shrink * ||theta||^2 on every client, nothing uploaded."""
  def client(group):
    def loss(c, batch, broadcast, key):
      logits, _, updated = train_forward(group.model, c, batch.x)
      l2 = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(c.params))
      return cross_entropy(logits, batch.y) + cfg.shrink * l2, updated
    return sgd_program(loss, group.training)
  return Algorithm('shrink', no_server, (Phase('shrink', client, keep_server),), local_head_evaluation)


# ------------------------------------------------------------------ its one registry line
@pytest.fixture
def registered(monkeypatch):
  monkeypatch.setitem(METHODS, 'shrink', Method(ShrinkConfig, shrink, 'Shrink: CE plus an L2 pull towards 0'))


def test_a_registered_method_gets_its_flag_and_runs_under_both_executors(registered):
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['prog', '--algorithm=shrink', '--shrink_weight=2.0', '--dataset=synthetic:8,8,1'], fv)
  assert cli.config_from_flags(fv).method_config == ShrinkConfig(2.0)

  from fedjax_het.run.experiment import build_federation
  cfg = dataclasses.replace(CFG, algorithm='shrink', models=('mlp',), rounds=1, join_ratio=1.0,
                            methods={'shrink': ShrinkConfig(2.0)})
  runs = {s: record_rounds(fed, fed.init(), 1) for s in ('sequential', 'vmap')
          for fed in [build_federation(dataclasses.replace(cfg, strategy=s))]}
  np.testing.assert_allclose(runs['vmap'].history[0]['train_loss'], runs['sequential'].history[0]['train_loss'],
                             rtol=1e-5)

  # The L2 term is there: one SGD step of rate lr on CE + w ||theta||^2 from theta scales theta by (1 - 2 lr w)
  # plus the CE step; with w = 2 and the run's rate the parameters shrink, where CE alone would not shrink them.
  initial = build_federation(dataclasses.replace(cfg, strategy='sequential')).init()
  norm = lambda state: float(sum(jnp.sum(p ** 2) for p in jax.tree.leaves(state.groups[0].params)))
  assert norm(runs['sequential'].states[0]) < 0.5 * norm(initial)


def test_a_factory_gets_its_config_and_the_run_fields_it_names():
  from fedjax_het.run.registry import Run
  seen = {}

  def factory(cfg, num_classes, rounds, label_counts):
    seen.update(cfg=cfg, num_classes=num_classes, rounds=rounds, label_counts=list(label_counts))
    return shrink(cfg, num_classes)
  run = Run(3, 4, 7, 16, lambda: np.array([1, 2, 3]))
  Method(ShrinkConfig, factory, 'a toy', reads=('num_classes', 'rounds', 'label_counts')).algorithm(
      ShrinkConfig(2.0), run)
  assert seen == dict(cfg=ShrinkConfig(2.0), num_classes=3, rounds=7, label_counts=[1, 2, 3])
  assert run.depends_on_rounds

  with pytest.raises(TypeError, match=r"reads \['classes'\], which are not fields of Run"):
    Method(ShrinkConfig, lambda cfg, classes: shrink(cfg, classes), 'misnamed', reads=('classes',))
