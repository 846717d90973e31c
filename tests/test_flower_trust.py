"""What one Flower node can and cannot do to a run (docs/distributed.md, "What a node can and cannot do").

In CI, over Flower's ClientApp and messages delivered in-process (`test_flower.InProcessGrid`): a node whose reply
comes after the round's timeout keeps the state it had (the server's word moves a node's state, never its own
training); a replayed reply, or one bound to another run, is rejected as the other bad replies are; and a node
that stays within every bound of the server's checks but scales its upload by 1,000 and reports every test row
correct, against grouped FedAvg under the robust options, where the honest clients' accuracies stay within 0.1
and the robust aggregates within 0.05 of the honest run's (and, without the options, do not). With -m slow: the
same node on a real Deployment Engine (tests/fixtures/inflating_node).
"""

import dataclasses
import json
import os

import numpy as np
import pytest

pytest.importorskip('flwr')

from flwr.app import Array, Context, RecordDict  # noqa: E402

from fedjax_het.flower import client_app  # noqa: E402
from fedjax_het.flower.node import deployed_config  # noqa: E402
from fedjax_het.flower.rounds import FlowerRounds  # noqa: E402
from fedjax_het.run.config import ExperimentConfig  # noqa: E402
from fedjax_het.run.experiment import train_and_evaluate  # noqa: E402
from test_flower import CFG, InProcessGrid, _rows  # noqa: E402


def _over(grid, cfg, workdir):
  return lambda fed: FlowerRounds(fed, grid, json.dumps(cfg.to_dict()), round_timeout=5, connect_timeout=5,
                                  workdir=str(workdir))


class RecordingGrid(InProcessGrid):
  """An InProcessGrid that keeps each (client, round, message type) -> (message, reply), and drops the replies of
  `late` (client, round) pairs after their node computed them: replies that came after the round's timeout,
  which the server never takes."""

  def __init__(self, node_dir, num_nodes, late=()):
    super().__init__(node_dir, num_nodes)
    self.late, self.exchanged = set(late), {}

  def send_and_receive(self, messages, timeout=None):
    replies = super().send_and_receive(messages, timeout)
    by_node = {m.metadata.dst_node_id: m for m in messages}
    kept = []
    for reply in replies:
      message = by_node[reply.metadata.src_node_id]
      k, r = reply.metadata.src_node_id - 100, int(message.content['config']['round'])
      self.exchanged[(k, r, message.metadata.message_type)] = (message, reply)
      if (k, r) not in self.late or message.metadata.message_type != 'train':
        kept.append(reply)
    return kept


def test_a_late_nodes_state_stays_as_it_was_and_its_next_round_starts_from_it(tmp_path):
  """Client 2's reply of round 1 comes after the timeout: the server counts it missing, so the node keeps no state
  after round 1, and its round-2 upload is what a node that never trained computes from the same message."""
  grid = RecordingGrid(str(tmp_path / 'nodes'), 4, late=[(2, 0)])
  train_and_evaluate(CFG, str(tmp_path / 'run'), progress=False, federation=_over(grid, CFG, tmp_path / 'run'))
  rows = _rows(tmp_path / 'run')
  assert [r['missing_clients'] for r in rows] == [[2], []]
  states = tmp_path / 'nodes' / 'run_test'
  assert sorted(os.listdir(states / 'client_2')) == ['after_round_000002.npz']
  assert sorted(os.listdir(states / 'client_0')) == ['after_round_000001.npz', 'after_round_000002.npz']
  message, reply = grid.exchanged[(2, 1, 'train')]
  assert message.content['config']['state-round'] == 0
  fresh = Context(run_id=1, node_id=102, node_config={'partition-id': 2, 'state-dir': str(tmp_path / 'fresh')},
                  state=RecordDict(), run_config={'run-name': 'test'})
  again = client_app.app(message, fresh)
  assert sorted(again.content['upload']) == sorted(reply.content['upload'])
  for key in reply.content['upload']:
    np.testing.assert_array_equal(again.content['upload'][key].numpy(), reply.content['upload'][key].numpy())


def test_a_pending_state_is_kept_only_for_the_round_the_server_names(tmp_path):
  from fedjax_het.flower.node import NodeStates
  states = NodeStates(str(tmp_path / 'client_0'))
  template = {'a': np.zeros(2)}
  states.save(1, {'a': np.ones(2)}, pending=True)
  states.settle(1)  # the server took round 1's upload
  assert states.rounds() == [1] and states.rounds(pending=True) == []
  states.save(3, {'a': np.full(2, 3.0)}, pending=True)
  states.settle(1)  # round 3's reply was not taken: the state after round 1 stands
  assert states.rounds() == [1] and states.rounds(pending=True) == []
  np.testing.assert_array_equal(states.load(1, template, exact=True)['a'], [1, 1])
  assert states.load(3, template, exact=True) is None
  states.save(4, {'a': np.full(2, 4.0)}, pending=True)
  states.forget_after(2)  # a server resumed from round 2 starts over from there
  assert states.rounds() == [1] and states.rounds(pending=True) == []


def test_a_server_resumed_without_its_record_of_taken_uploads_refuses_to_start(tmp_path):
  from fedjax_het.errors import ConfigError
  from fedjax_het.run.experiment import build_federation
  rounds = FlowerRounds(build_federation(CFG), None, json.dumps(CFG.to_dict()), 1, 1, workdir=str(tmp_path))
  with pytest.raises(ConfigError, match=r'resumes from round 2 without a readable record of the uploads it took '
                                        r'.* Fix: resume with the workdir the run wrote'):
    rounds._connect(2)
  (tmp_path / 'flower_taken.json').write_text('{"1": [0, 1], "2": [1], "3": [0]}')
  rounds.taken = rounds._read_ledger(2)  # a round after the checkpoint resumed from is forgotten
  assert [rounds.state_round(k) for k in range(4)] == [1, 2, 0, 0]


class ReplayingGrid(RecordingGrid):
  """From round 2 on, client 1's node answers each message with its reply of round 1 (replayed whole, its binding
  included), and client 3's node with its own fresh reply bound to another run's token."""

  def send_and_receive(self, messages, timeout=None):
    replies = super().send_and_receive(messages, timeout)
    out = []
    for reply in replies:
      k = reply.metadata.src_node_id - 100
      kind = next(m.metadata.message_type for m in messages if m.metadata.dst_node_id == reply.metadata.src_node_id)
      r = next(int(m.content['config']['round']) for m in messages
               if m.metadata.dst_node_id == reply.metadata.src_node_id)
      if r >= 1 and k == 1 and kind in ('train', 'evaluate'):
        reply = self.exchanged[(1, 0, kind)][1]
      elif r >= 1 and k == 3 and 'reply' in reply.content:
        reply.content['reply']['run'] = 'another run'
      out.append(reply)
    return out


def test_a_replayed_reply_and_one_of_another_run_are_rejected(tmp_path):
  """Client 1 replays its round-1 upload and scores in round 2 (every shape and bound the server checks holds),
  client 3 answers for another run: both are left out as the other bad replies are."""
  grid = ReplayingGrid(str(tmp_path / 'nodes'), 4)
  train_and_evaluate(CFG, str(tmp_path / 'run'), progress=False, federation=_over(grid, CFG, tmp_path / 'run'))
  rows = _rows(tmp_path / 'run')
  assert [r['rejected_clients'] for r in rows] == [[], [1, 3]]
  assert [r.get('rejected_scores', []) for r in rows] == [[], [1, 3]]
  assert rows[1]['participants'] == 2 and rows[1]['evaluated_clients'] == 2


# Grouped FedAvg on digits, 6 clients (mlp: 0, 2, 4; small_cnn_narrow: 1, 3, 5), IID, where 3 rounds learn.
ATTACKED = deployed_config(ExperimentConfig(algorithm='fedavg', dataset='digits', num_clients=6,
                                            models=('mlp', 'small_cnn_narrow'), feature_dim=16, rounds=3,
                                            batch_size=16, partition='iid', local_epochs=3, local_learning_rate=0.5,
                                            checkpoint_every=0))
HONEST = (0, 1, 3, 4, 5)
# Under the robust options, every round, of the honest run's: each honest client's accuracy, and the robust
# aggregates (the server's own accuracy, the median of the reported ones). Measured: 0.054 and 0.027 at most.
TOLERANCE, AGGREGATE_TOLERANCE = 0.1, 0.05


def inflate(reply, scale: float = 1000.0) -> None:
  """A reply of client 2's node as it tampers with it within every bound of the server's checks: its upload's
  floating arrays times `scale`, and every test row reported correct."""
  content = reply.content
  if 'upload' in content:
    for key in list(content['upload'].keys()):
      a = content['upload'][key].numpy()
      if np.issubdtype(a.dtype, np.floating):
        content['upload'][key] = Array(a * scale)
  elif 'metrics' in content:
    for which in ('local', 'global'):
      if f'{which}_rows' in content['metrics']:
        rows = content['metrics'][f'{which}_rows']
        content['metrics'][f'{which}_correct'] = [rows] * len(content['metrics'][f'{which}_correct'])


class InflatingGrid(InProcessGrid):
  """An InProcessGrid whose node of client 2 scales its uploads by 1,000 and forges its scores (`inflate`)."""

  def send_and_receive(self, messages, timeout=None):
    replies = super().send_and_receive(messages, timeout)
    for reply in replies:
      if reply.metadata.src_node_id == 102:
        inflate(reply)
    return replies


def check_against_the_honest_run(rows, honest, robust: bool):
  """Under the robust options: every honest client's accuracy within TOLERANCE of the honest run's, the server's
  own accuracy and the median of the clients' reported accuracies within AGGREGATE_TOLERANCE, every round (the
  reported mean is what the forged scores move). Without them: the mlp group's honest clients are rejected once
  they train from the poisoned model, and the server's accuracy falls beyond the tolerance."""
  for a, b in zip(rows, honest):
    assert a['client_accuracy'][2] == 1.0  # the forged score, reported as it came
    median = float(np.median(b['client_accuracy']))
    if robust:
      assert a['rejected_clients'] == [] and a['evaluated_clients'] == 6, a['round']
      for k in HONEST:
        assert abs(a['client_accuracy'][k] - b['client_accuracy'][k]) <= TOLERANCE, (a['round'], k)
      assert abs(a['server_accuracy'] - b['accuracy']) <= AGGREGATE_TOLERANCE, a['round']
      assert abs(a['client_accuracy_median'] - median) <= AGGREGATE_TOLERANCE, a['round']
  if not robust:
    assert rows[1]['rejected_clients'] == [0, 2, 4]
    assert rows[-1]['server_accuracy'] < honest[-1]['accuracy'] - TOLERANCE
    assert rows[0]['accuracy'] > rows[0]['server_accuracy'] + 0.05  # the forged scores inflate the mean


# In the slow set (`-m slow`, about 8 s a mode): the default run checks each option's statistic by hand and on a
# simulated round (tests/test_robust.py) and the checks of a Flower server on its replies below.
@pytest.mark.slow
@pytest.mark.parametrize('mode', ['none', 'median', 'norm_bound'])
def test_one_node_scaling_its_uploads_and_forging_its_scores_against_the_robust_options(tmp_path, mode):
  """Each option against the honest run under the same option (the simulation, every client honest); without
  them, against plain FedAvg's."""
  cfg = dataclasses.replace(ATTACKED, robust_aggregation=mode)
  train_and_evaluate(cfg, str(tmp_path / f'honest_{mode}'), progress=False)
  workdir = tmp_path / mode
  train_and_evaluate(cfg, str(workdir), progress=False,
                     federation=_over(InflatingGrid(str(tmp_path / f'nodes_{mode}'), 6), cfg, workdir))
  rows, honest = _rows(workdir), _rows(tmp_path / f'honest_{mode}')
  assert len(rows) == 3
  check_against_the_honest_run(rows, honest, robust=mode != 'none')
  if mode == 'norm_bound':
    assert [r['robust_clipped'] for r in rows] == [1, 1, 1]  # client 2's update, each round


@pytest.mark.slow
def test_a_deployment_with_an_inflating_node_under_the_median(tmp_path):
  """6 SuperNodes on localhost; client 2's scales its uploads by 1,000 and forges its scores
  (tests/fixtures/inflating_node); under --robust_aggregation=median the honest clients and the robust aggregates
  stay within TOLERANCE of the honest simulation."""
  from fedjax_het.flower.local import LocalDeployment
  flagfile = tmp_path / 'fedavg.flags'
  flagfile.write_text('\n'.join(f'--{k}={",".join(v) if isinstance(v, tuple) else v}' for k, v in {
      'algorithm': 'fedavg', 'dataset': 'digits', 'num_clients': 6, 'models': ('mlp', 'small_cnn_narrow'),
      'feature_dim': 16, 'rounds': 3, 'batch_size': 16, 'partition': 'iid', 'local_epochs': 3,
      'local_learning_rate': 0.5, 'checkpoint_every': 1, 'robust_aggregation': 'median'}.items()))
  fixture = os.path.join(os.path.dirname(__file__), 'fixtures', 'inflating_node')
  deployment = LocalDeployment(6, str(tmp_path / 'flower'))
  honest_start = deployment.start_supernode
  lying = {'PYTHONPATH': os.pathsep.join([fixture, os.environ.get('PYTHONPATH', '')])}
  deployment.start_supernode = lambda k, env=None, identity=None: honest_start(k, lying if k == 2 else env, identity)
  try:
    deployment.start()  # client 2's SuperNode lies from its start
    with open(tmp_path / 'flwr_run.log', 'w') as log:
      status = deployment.run(str(flagfile), round_timeout=300, stdout=log)
  finally:
    deployment.stop()
  assert status == 0, (tmp_path / 'flwr_run.log').read_text()[-3000:]
  train_and_evaluate(dataclasses.replace(ATTACKED, robust_aggregation='median'), str(tmp_path / 'honest'),
                     progress=False)
  check_against_the_honest_run(_rows(tmp_path / 'flower'), _rows(tmp_path / 'honest'), robust=True)
