"""The Flower deployment (fedjax_het.flower) runs a method's rounds with the simulation's numbers.

In CI: pytrees through ArrayRecords, the nodes' state files, and `FlowerRounds` over Flower's own ClientApp and
Message objects delivered in-process (every reply in: the simulation's metrics; a server restarted from an
earlier checkpoint ends where it would have; a node that stops answering: the round goes on without it); the
command line of `python -m fedjax_het.flower.local` (flags after --flagfile reach the ServerApp through Flower's
run config; a bad flag is one line) and the app's run-config keys. With -m slow: a real Deployment Engine on
localhost (SuperLink + 4 SuperNodes as processes), FedRE and FedProto equal to the simulation, a SuperNode killed
mid-run, and the local command with overrides.
"""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flwr = pytest.importorskip('flwr')

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedjax_het.errors import ConfigError  # noqa: E402
from fedjax_het.flower import client_app  # noqa: E402
from fedjax_het.flower.node import NodeStates, deployed_config  # noqa: E402
from fedjax_het.flower.records import tree_from_record, tree_to_record  # noqa: E402
from fedjax_het.flower.rounds import FlowerRounds  # noqa: E402
from fedjax_het.run.config import ExperimentConfig  # noqa: E402
from fedjax_het.run.experiment import train_and_evaluate  # noqa: E402

CFG = deployed_config(ExperimentConfig(algorithm='fedre', dataset='digits', num_clients=4,
                                       models=('mlp', 'small_cnn_narrow'), feature_dim=16, rounds=2,
                                       batch_size=16, checkpoint_every=1))


def test_records_round_trip_and_refuse_another_structure():
  tree = {'w': jnp.arange(6.0).reshape(2, 3), 'n': (np.int32(3), None), 'key': jax.random.PRNGKey(1)}
  back = tree_from_record(tree_to_record(tree), tree, 'the test tree')
  assert jax.tree.structure(back) == jax.tree.structure(tree)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree)):
    assert a.dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(a, b)
  other = dict(tree, w=jnp.zeros((3, 2)))
  with pytest.raises(ConfigError, match=r'the test tree: leaf 2 is float32\[2, 3\], expected float32\[3, 2\]'):
    tree_from_record(tree_to_record(tree), other, 'the test tree')


def test_node_states_give_the_newest_state_at_or_before_a_round(tmp_path):
  states = NodeStates(str(tmp_path / 'client_0'))
  template = {'a': jnp.zeros(2)}
  assert states.load(5, template) is None
  states.save(1, {'a': jnp.ones(2)})
  states.save(3, {'a': jnp.full(2, 3.0)})
  assert states.load(0, template) is None
  np.testing.assert_array_equal(states.load(2, template)['a'], [1, 1])
  np.testing.assert_array_equal(states.load(9, template)['a'], [3, 3])
  states.forget_after(2)  # a run resumed from round 2 starts over from there
  assert states.rounds() == [1]


class InProcessGrid:
  """Flower's Grid, its messages delivered to the ClientApp of the addressed node in this process. `silent`:
  client id -> the first round (0-based) from which its node answers nothing (as a node that went down)."""

  def __init__(self, node_dir: str, num_nodes: int, silent: dict = {}):
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    self.contexts = {100 + k: Context(run_id=1, node_id=100 + k, node_config={'partition-id': k, 'state-dir': node_dir},
                                      state=RecordDict(), run_config={'run-name': 'test'}) for k in range(num_nodes)}
    self.silent = silent

  def get_node_ids(self):
    return list(self.contexts)

  def send_and_receive(self, messages, timeout=None):
    replies = []
    for m in messages:
      k = m.metadata.dst_node_id - 100
      if k in self.silent and int(m.content['config']['round']) >= self.silent[k]:
        continue
      reply = client_app.app(m, self.contexts[m.metadata.dst_node_id])
      replies.append(reply)
    return replies


def _rows(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_rounds_over_flower_messages_equal_the_simulation_and_go_on_without_a_silent_node(tmp_path):
  cfg_json = json.dumps(CFG.to_dict())
  said = []
  over = lambda grid, workdir=None, progress=None: (lambda fed: FlowerRounds(
      fed, grid, cfg_json, round_timeout=5, connect_timeout=5, workdir=workdir, progress=progress))
  train_and_evaluate(CFG, str(tmp_path / 'flower'), progress=False,
                     federation=over(InProcessGrid(str(tmp_path / 'nodes'), 4), str(tmp_path / 'flower'), said.append))
  # The waits of the first round and evaluation are announced once each, before they start.
  assert said == ['waiting for the SuperNodes of the 4 clients to connect (at most 5 s, connect-timeout)',
                  '4 SuperNodes connected, one per client',
                  'round 1/2: training on 4 nodes; each node starts a ClientApp process that builds its client and '
                  'compiles its programs (the first time waits longest)',
                  'round 1/2: evaluating on 4 nodes; each node starts a ClientApp process that builds its client and '
                  'compiles its programs (the first time waits longest)'], said
  train_and_evaluate(CFG, str(tmp_path / 'simulation'), progress=False)
  flower, simulation = _rows(tmp_path / 'flower'), _rows(tmp_path / 'simulation')
  assert len(flower) == len(simulation) == 2
  for a, b in zip(flower, simulation):
    assert a['missing_clients'] == [] and a['evaluated_clients'] == 4
    for k in b:
      if 'seconds' not in k:
        assert a[k] == b[k], (a['round'], k)
  # The server restarts from the checkpoint of round 1 (the later one lost): nodes keep their states, round 2 is
  # run again and ends where the uninterrupted run ended.
  import shutil
  shutil.rmtree(tmp_path / 'flower' / 'checkpoints' / '2')
  train_and_evaluate(CFG, str(tmp_path / 'flower'), resume=True, progress=False,
                     federation=over(InProcessGrid(str(tmp_path / 'nodes'), 4), str(tmp_path / 'flower')))
  resumed = _rows(tmp_path / 'flower')
  assert [r['round'] for r in resumed] == [1, 2]
  assert {k: v for k, v in resumed[1].items() if 'seconds' not in k} == {
      k: v for k, v in flower[1].items() if 'seconds' not in k}
  # Client 3's node answers nothing from round 2 on: that round trains and scores the other three.
  train_and_evaluate(dataclasses.replace(CFG, seed=0), str(tmp_path / 'silent'), progress=False,
                     federation=over(InProcessGrid(str(tmp_path / 'nodes_silent'), 4, silent={3: 1})))
  silent = _rows(tmp_path / 'silent')
  assert [r['missing_clients'] for r in silent] == [[], [3]]
  assert [r['participants'] for r in silent] == [4, 3] and silent[1]['evaluated_clients'] == 3
  assert silent[0]['accuracy'] == flower[0]['accuracy'] and silent[1]['accuracy'] != flower[1]['accuracy']
  assert json.loads((tmp_path / 'silent' / 'summary.json').read_text())['finished']
  # A node whose config names another architecture than its client's is refused, naming both.
  from flwr.app import Message, MessageType
  from fedjax_het.flower.rounds import message_config
  query = Message(RecordDict({'config': message_config(cfg_json, 0)}), dst_node_id=100,
                  message_type=MessageType.QUERY)
  context = Context(run_id=1, node_id=100, node_config={'partition-id': 1, 'architecture': 'mlp'},
                    state=RecordDict(), run_config={})
  with pytest.raises(ConfigError, match="architecture='mlp': client 1 of this run has 'small_cnn_narrow'"):
    client_app.node_of(query, context)


class MaliciousGrid(InProcessGrid):
  """An InProcessGrid whose nodes of clients 1-3 tamper with their replies from round 2 on: client 3 uploads NaN,
  client 2 an array of another shape, client 1 reports a NaN loss and inflated evaluation counts."""

  def send_and_receive(self, messages, timeout=None):
    from flwr.app import Array
    replies = super().send_and_receive(messages, timeout)
    for reply in replies:
      k, r = reply.metadata.src_node_id - 100, None
      content = reply.content
      for m in messages:
        if m.metadata.dst_node_id == reply.metadata.src_node_id:
          r = int(m.content['config']['round'])
      if r < 1:
        continue
      if 'upload' in content:
        first = content['upload']['00000'].numpy()
        if k == 3:
          content['upload']['00000'] = Array(np.full_like(first, np.nan))
        elif k == 2:
          content['upload']['00000'] = Array(np.zeros(first.shape + (2,), first.dtype))
        elif k == 1:
          content['metrics']['loss'] = float('nan')
      elif k == 1:
        for which in ('local', 'global'):
          if f'{which}_rows' in content['metrics']:
            rows = content['metrics'][f'{which}_rows']
            content['metrics'][f'{which}_rows'] = 1000 * rows
            content['metrics'][f'{which}_correct'] = [999 * rows]
    return replies


def test_replies_that_fail_the_servers_checks_are_left_out_and_the_run_finishes(tmp_path):
  cfg = dataclasses.replace(CFG, rounds=3)
  cfg_json = json.dumps(cfg.to_dict())
  train_and_evaluate(cfg, str(tmp_path / 'run'), progress=False, federation=lambda fed: FlowerRounds(
      fed, MaliciousGrid(str(tmp_path / 'nodes'), 4), cfg_json, round_timeout=5, connect_timeout=5))
  rows = _rows(tmp_path / 'run')
  assert [r['rejected_clients'] for r in rows] == [[], [1, 2, 3], [1, 2, 3]]
  assert [r['participants'] for r in rows] == [4, 1, 1]
  assert all(np.isfinite(r['train_loss']) for r in rows)
  assert [r.get('rejected_scores', []) for r in rows] == [[], [1], [1]]
  assert [r['evaluated_clients'] for r in rows] == [4, 3, 3]
  assert all(0 <= r['accuracy'] <= 1 for r in rows)
  summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert summary['finished'] and 0 <= summary['final_accuracy'] <= 1


def test_a_run_name_from_the_server_never_reaches_outside_the_nodes_state_folder(tmp_path):
  from flwr.app import Message, MessageType
  from fedjax_het.flower.rounds import message_config
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
  query = Message(RecordDict({'config': message_config(json.dumps(CFG.to_dict()), 0)}), dst_node_id=100,
                  message_type=MessageType.QUERY)
  state_dir = tmp_path / 'nodes'
  for name in ('x/../../../escaped', '..', '/etc', 'a b', '', '.hidden'):
    context = Context(run_id=1, node_id=100, node_config={'partition-id': 0, 'state-dir': str(state_dir)},
                      state=RecordDict(), run_config={'run-name': name})
    with pytest.raises(ConfigError, match=r"^run config run-name=.*: a run name is 1-128 letters.*Fix: "):
      client_app.node_of(query, context)
  assert not (tmp_path / 'escaped').exists() and not state_dir.exists()
  context = Context(run_id=1, node_id=100, node_config={'partition-id': 0, 'state-dir': str(state_dir)},
                    state=RecordDict(), run_config={'run-name': 'cifar10-fedre_seed.0'})
  node, _ = client_app.node_of(query, context)
  assert node.states.directory == str(state_dir / 'run_cifar10-fedre_seed.0' / 'client_0')


def test_a_nodes_local_dp_policy_holds_whatever_config_the_server_sends(tmp_path):
  """A node started with dp-mode="local" takes part only in runs that noise its uploads on the node at least as
  its policy says; the server's config cannot switch it off (it could, by sending dp_mode=off)."""
  from flwr.app import Message, MessageType
  from fedjax_het.flower.rounds import message_config
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
  policy = {'partition-id': 0, 'state-dir': str(tmp_path), 'dp-mode': 'local', 'dp-noise-multiplier': 1.0}

  def query(cfg, node_config):
    message = Message(RecordDict({'config': message_config(json.dumps(cfg.to_dict()), 0)}), dst_node_id=100,
                      message_type=MessageType.QUERY)
    return client_app.node_of(message, Context(run_id=1, node_id=100, node_config=node_config, state=RecordDict(),
                                               run_config={'run-name': 'dp'}))
  with pytest.raises(ConfigError, match=r'^this node uploads only with local DP .* the run asks for --dp_mode=off'):
    query(CFG, policy)
  central = dataclasses.replace(CFG, dp_mode='central', dp_noise_multiplier=2.0)
  with pytest.raises(ConfigError, match=r'asks for --dp_mode=central'):
    query(central, policy)
  weak = dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=0.5)
  with pytest.raises(ConfigError, match=r'^this node uploads only with noise multiplier >= 1 .* the run\'s is 0\.5\. '
                                        r'Fix: run with --dp_noise_multiplier >= 1'):
    query(weak, policy)
  strong = dataclasses.replace(CFG, dp_mode='local', dp_noise_multiplier=1.5)
  node, _ = query(strong, policy)
  assert node.client_id == 0
  with pytest.raises(ConfigError, match=r'^this node uploads only in runs that spend epsilon <= 0\.01 .* this run '
                                        r'spends [0-9.]+ at delta 1e-05'):
    query(strong, {**policy, 'dp-max-epsilon': 0.01})
  query(strong, {**policy, 'dp-max-epsilon': 1e6})
  query(weak, {'partition-id': 0, 'state-dir': str(tmp_path)})  # no policy: the run's config decides


def test_a_second_node_claiming_a_client_is_refused_and_never_blocks_the_run(tmp_path, caplog):
  from fedjax_het.run.experiment import build_federation
  from fedjax_het.flower.rounds import NodesUnavailable, assign_nodes
  grid = InProcessGrid(str(tmp_path / 'nodes'), 4)
  impostor = Context(run_id=1, node_id=99, node_config={'partition-id': 0, 'state-dir': str(tmp_path / 'x')},
                     state=RecordDict(), run_config={'run-name': 'test'})
  grid.contexts = {99: impostor, **grid.contexts}  # it connected first
  fed, cfg_json = build_federation(CFG), json.dumps(CFG.to_dict())
  # Without registered keys the first claim stands, the second is refused, and the run goes on.
  assert assign_nodes(grid, fed, cfg_json, 0, 5, poll_seconds=0.01) == {0: 99, 1: 101, 2: 102, 3: 103}
  assert 'SuperNode 100 claims client 0, which SuperNode 99 holds: refused' in caplog.text
  # With the node ids of the keys registered for the clients, only the registered node's claim is taken.
  registered = {k: 100 + k for k in range(4)}
  assert assign_nodes(grid, fed, cfg_json, 0, 5, poll_seconds=0.01, registered=registered) == registered
  assert 'SuperNode 99 claims client 0, whose registered SuperNode is 100: refused' in caplog.text
  del grid.contexts[100]  # the registered node of client 0 never connects: the impostor does not take its place
  with pytest.raises(NodesUnavailable, match=r'no SuperNode holds clients \[0\] after 0.2 s .*Refused: SuperNode 99 '
                                             r'claims client 0'):
    assign_nodes(grid, fed, cfg_json, 0, 0.2, poll_seconds=0.01, registered=registered)


def test_a_node_whose_first_query_was_not_delivered_is_asked_again(tmp_path):
  """A node restarting as the run starts: its first QUERY comes back 'node unavailable' and the next gets no reply;
  it is asked again at each poll and holds its client once it answers. A ClientApp's own refusal stands."""
  from flwr.app import Error, Message
  from flwr.common.constant import ErrorCode
  from fedjax_het.run.experiment import build_federation
  from fedjax_het.flower.rounds import NodesUnavailable, assign_nodes

  class Restarting(InProcessGrid):
    def __init__(self, *args, failures=2):
      super().__init__(*args)
      self.failures, self.asked = failures, []

    def send_and_receive(self, messages, timeout=None):
      replies = []
      for m in messages:
        self.asked.append(m.metadata.dst_node_id)
        if m.metadata.dst_node_id == 101 and self.failures:
          self.failures -= 1
          if self.failures:  # the first: not delivered; the second: no reply at all
            replies.append(Message(error=Error(ErrorCode.NODE_UNAVAILABLE, 'Node Unavailable'), reply_to=m))
          continue
        replies.extend(super().send_and_receive([m], timeout))
      return replies
  fed, cfg_json = build_federation(CFG), json.dumps(CFG.to_dict())
  grid = Restarting(str(tmp_path / 'nodes'), 4)
  assert assign_nodes(grid, fed, cfg_json, 0, 5, poll_seconds=0.01) == {0: 100, 1: 101, 2: 102, 3: 103}
  assert grid.asked.count(101) == 3 and grid.asked.count(100) == 1
  grid = Restarting(str(tmp_path / 'nodes'), 4, failures=10**6)  # it never comes back
  with pytest.raises(NodesUnavailable, match=r'no SuperNode holds clients \[1\] .* Not answering: SuperNode 101 '):
    assign_nodes(grid, fed, cfg_json, 0, 0.2, poll_seconds=0.01)


def test_each_train_message_carries_only_its_clients_slice_of_a_per_client_broadcast():
  from fedjax_het.methods import FedGKTConfig
  from fedjax_het.core import PerClient
  from fedjax_het.run.experiment import build_federation
  cfg = dataclasses.replace(CFG, algorithm='fedgkt', methods={'fedgkt': FedGKTConfig(server_blocks=1)})
  fed = build_federation(cfg)
  state = fed.init()
  rounds = FlowerRounds(fed, None, json.dumps(cfg.to_dict()), 1, 1)
  rounds.nodes = {k: 100 + k for k in range(4)}
  TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # what Flower's runtime sets
  broadcasts = [fed.sent(state.server, gi, 0) for gi in range(len(fed.groups))]
  for gi, b in enumerate(broadcasts):  # client i of each group: logits all equal to 10 * group + i
    own = b.own.values
    n = own.logits.shape[0]
    logits = jnp.broadcast_to((10.0 * gi + jnp.arange(n))[:, None, None], own.logits.shape)
    broadcasts[gi] = b._replace(own=PerClient(own._replace(logits=logits)))
  for m in rounds._messages(range(4), broadcasts, 0, 'train'):
    k = m.metadata.dst_node_id - 100
    gi = int(fed.group_of[k])
    i = int(np.flatnonzero(fed.groups[gi].clients == k)[0])
    arrays = [m.content['broadcast'][key].numpy() for key in sorted(m.content['broadcast'])]
    logits = [a for a in arrays if a.ndim == 2 and a.shape[0] == fed.groups[gi].train.x.shape[1]]
    assert len(logits) == 1 and (logits[0] == 10.0 * gi + i).all()
    assert not any(a.ndim == 3 and a.shape[-1] == 10 for a in arrays)


@pytest.mark.slow
def test_a_per_client_broadcast_reaches_each_node_alone_and_equals_the_simulation(tmp_path):
  """FedGKT's server sends each client its own rows' logits: every TRAIN message carries one client's slice (not
  the group's), and the rounds equal the simulation's."""
  from fedjax_het.methods import FedGKTConfig
  cfg = dataclasses.replace(CFG, algorithm='fedgkt', rounds=2, join_ratio=1.0, methods={
      'fedgkt': FedGKTConfig(server_epochs=1, server_blocks=1)})

  class Recording(InProcessGrid):
    sent = []

    def send_and_receive(self, messages, timeout=None):
      for m in messages:
        if m.metadata.message_type == 'train':
          record = m.content['broadcast']
          self.sent.append([record[k].numpy().shape for k in sorted(record)])
      return super().send_and_receive(messages, timeout)

  grid = Recording(str(tmp_path / 'nodes'), 4)
  train_and_evaluate(cfg, str(tmp_path / 'flower'), progress=False, federation=lambda fed: FlowerRounds(
      fed, grid, json.dumps(cfg.to_dict()), round_timeout=5, connect_timeout=5))
  train_and_evaluate(cfg, str(tmp_path / 'simulation'), progress=False)
  flower, simulation = _rows(tmp_path / 'flower'), _rows(tmp_path / 'simulation')
  assert len(flower) == len(simulation) == 2
  for a, b in zip(flower, simulation):
    for k in b:
      if 'seconds' not in k:
        assert a[k] == b[k], (a['round'], k)
  assert flower[1]['broadcast_scalars'] > 0  # logits went out
  # Each TRAIN message: one client's [rows, 10] logits and its flag, never the group's [clients, rows, 10].
  assert len(grid.sent) == 8
  for shapes in grid.sent:
    assert () in shapes  # its flag, a scalar
    assert not any(len(s) == 3 and s[-1] == 10 for s in shapes)


def _flower_run_config(deployment, run) -> dict:
  """The run config the ServerApp gets for a parsed local command line: `flwr run`'s --run-config argument,
  parsed and merged with the app's pyproject.toml by Flower's own functions (which refuse a key it does not
  list, as the SuperLink does)."""
  from pathlib import Path
  from flwr.common.config import get_fused_config_from_dir, parse_config_args
  from fedjax_het.flower.run_config import APP_DIR, run_config_argument
  argument = run_config_argument(deployment.run_config(run.flagfile, overrides=run.overrides))
  return get_fused_config_from_dir(Path(APP_DIR), parse_config_args([argument]))


def test_local_flags_after_the_flagfile_reach_the_server_app_and_its_run(tmp_path):
  """--rounds=2, --local_learning_rate=0.05 and --noshared_init after a flag file of 3 rounds (and the defaults):
  the command's config, the run config it hands to `flwr run` and the ServerApp's run (over in-process nodes)
  all take them."""
  from flwr.app import Context
  from fedjax_het.flower import local, server_app
  flagfile = _flagfile(tmp_path, 'fedre')
  workdir = str(tmp_path / 'run')
  run = local.parse_command_line([f'--flagfile={flagfile}', f'--workdir={workdir}', '--rounds=2',
                                  '--local_learning_rate=0.05', '--noshared_init', '--round_timeout=30'])
  assert (run.config.rounds, run.config.local_learning_rate, run.config.shared_init) == (2, 0.05, False)
  assert run.overrides == {'rounds': 2, 'local-learning-rate': 0.05, 'shared-init': False}
  assert run.flags.round_timeout == 30 and run.flagfile == flagfile
  run_config = _flower_run_config(local.LocalDeployment(4, workdir), run)
  assert (run_config['rounds'], run_config['num-clients'], run_config['flagfile']) == (2, '', flagfile)
  # The ServerApp itself, its nodes' messages delivered in-process.
  server_app.main(InProcessGrid(str(tmp_path / 'nodes'), 4), Context(
      run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=dict(run_config, **{
          'round-timeout': 30.0, 'connect-timeout': 5.0})))
  assert [r['round'] for r in _rows(workdir)] == [1, 2]
  config = json.loads((tmp_path / 'run' / 'summary.json').read_text())['config']
  assert (config['rounds'], config['local_learning_rate'], config['shared_init']) == (2, 0.05, False)
  assert (config['num_clients'], config['models']) == (4, ['mlp', 'small_cnn_narrow'])  # the flag file's


def test_a_bad_local_flag_is_one_line_naming_it_and_help_exits_0(tmp_path, capsys):
  from fedjax_het.flower import local, server_app
  flagfile = _flagfile(tmp_path, 'fedre')
  start = [f'--flagfile={flagfile}', f'--workdir={tmp_path / "run"}']
  for bad, says in [('--roundz=2', '--roundz is not a flag of this command (did you mean --rounds?). Fix: --rounds, '
                                   'if that is the one meant; --help lists this command\'s flags, --helpfull every flag.'),
                    ('--rounds=two', '--rounds=two: not an integer. Fix: --rounds takes an integer.'),
                    ('--strategy=vmap', '--strategy: each node trains its one client with the sequential executor. '
                                        'Fix: leave --strategy out.'),
                    ('--local_learning_rate=-1', '--local_learning_rate')]:
    assert local.main(start + [bad]) == 2, bad
    err = capsys.readouterr().err
    assert err.startswith('error: ') and says in err and err.count('\n') == 1 and 'Traceback' not in err, err
  assert local.main(['--flagfile=no/such.flags', '--workdir=x']) == 2
  assert 'Fix: the path of a flag file' in capsys.readouterr().err
  assert local.main(['--help']) == 0
  out = capsys.readouterr().out
  assert '--round_timeout' in out and '--engine' in out and 'Data:' in out and '--rounds' in out
  assert '  --strategy' not in out  # a Flower run sets it
  # Over Flower's run config: a bad value names its flag; a key the app does not list is refused by Flower.
  with pytest.raises(ConfigError, match=r"--rounds=two: not an integer\. Fix: --rounds takes an integer"):
    server_app.experiment_flags({'flagfile': flagfile, 'rounds': 'two', 'seed': ''})
  from pathlib import Path
  from flwr.common.config import get_fused_config_from_dir, parse_config_args
  from fedjax_het.flower.run_config import APP_DIR
  with pytest.raises(ValueError, match="Key 'roundz' is not present"):
    get_fused_config_from_dir(Path(APP_DIR), parse_config_args(['rounds=2 roundz=2']))


def test_the_run_config_tool_answers_help_and_a_missing_file_in_one_line(capsys):
  from fedjax_het.flower import run_config
  assert run_config.main(['--help']) == 0
  assert capsys.readouterr().out.startswith('usage: python -m fedjax_het.flower.run_config [PYPROJECT_TOML]')
  assert run_config.main(['no_such_pyproject.toml']) == 2
  assert capsys.readouterr().err.startswith('error: cannot read no_such_pyproject.toml (No such file or directory). '
                                            'Fix: ')


def test_the_flower_app_lists_a_run_config_key_per_experiment_flag():
  """Flower refuses a --run-config key its pyproject.toml does not list: the app lists every experiment flag
  (python -m fedjax_het.flower.run_config rewrites the block when flags change)."""
  import tomllib
  from fedjax_het.flower import run_config
  path = os.path.join(run_config.APP_DIR, 'pyproject.toml')
  with open(path) as f:
    text = f.read()
  assert run_config.with_block(text, run_config.pyproject_block()) == text, (
      'experiments/flower/pyproject.toml lists other flags than fedjax_het.run.cli defines. Fix: python -m '
      'fedjax_het.flower.run_config')
  keys = tomllib.loads(text)['tool']['flwr']['app']['config']
  assert set(keys) == set(run_config.DEPLOYMENT_KEYS) | set(run_config.experiment_keys())
  assert run_config.override_arguments({'rounds': 2, 'num-clients': '', 'drop-last': False, 'models': 'mlp,cnn',
                                        'workdir': '/out'}) == ['--rounds=2', '--drop_last=false', '--models=mlp,cnn']


FLAGS = '''--dataset=digits
--num_clients=4
--models=mlp,small_cnn_narrow
--feature_dim=16
--rounds=3
--batch_size=16
--checkpoint_every=1
'''


def _flagfile(tmp_path, algorithm: str) -> str:
  path = tmp_path / f'{algorithm}.flags'
  path.write_text(FLAGS + f'--algorithm={algorithm}\n')
  return str(path)


def _flower_equals_simulation(tmp_path, algorithm: str, simulation: bool):
  """Runs the flags on a local Flower deployment (or the Simulation Engine) and in-process; asserts every round's
  metrics equal; returns the config."""
  from fedjax_het.flower.local import LocalDeployment
  from fedjax_het.flower.server_app import config_from_flagfile
  flagfile = _flagfile(tmp_path, algorithm)
  with LocalDeployment(4, str(tmp_path / 'flower'), simulation=simulation) as deployment:
    with open(tmp_path / 'flwr_run.log', 'w') as log:
      assert deployment.run(flagfile, round_timeout=300, stdout=log) == 0
  cfg = deployed_config(config_from_flagfile(flagfile))
  train_and_evaluate(cfg, str(tmp_path / 'simulation'), progress=False)
  flower, simulation = _rows(tmp_path / 'flower'), _rows(tmp_path / 'simulation')
  assert len(flower) == len(simulation) == 3, (tmp_path / 'flwr_run.log').read_text()[-3000:]
  for a, b in zip(flower, simulation):
    for k in b:
      if 'seconds' not in k:
        assert a[k] == b[k], (a['round'], k)
  return cfg


@pytest.mark.slow
@pytest.mark.parametrize('algorithm', ['fedre', 'fedproto'])
def test_deployment_on_localhost_equals_the_simulation(tmp_path, algorithm):
  """A SuperLink and 4 SuperNodes as processes on localhost (2 architectures), 3 rounds: every round's metrics
  and the final server state equal the in-process simulation's."""
  from fedjax_het.run.checkpoints import Checkpoints
  from fedjax_het.run.experiment import build_federation
  template = build_federation(_flower_equals_simulation(tmp_path, algorithm, simulation=False)).init()
  saved = [Checkpoints(str(tmp_path / w / 'checkpoints')).restore_latest(t)[0].server
           for w, t in (('flower', template._replace(groups=())), ('simulation', template))]
  for x, y in zip(jax.tree.leaves(saved[0]), jax.tree.leaves(saved[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_a_supernode_killed_mid_run_is_left_out_and_the_run_finishes(tmp_path):
  """Client 3's SuperNode is killed (SIGKILL, with its ClientApp) after round 1: rounds 2 and 3 wait
  round-timeout for it, then go on with the other three clients; the run finishes. The timeout leaves a live
  node's ClientApp (a new process per message: JAX's start, its programs read from the cache) time to answer on a
  machine shared with another test worker (at 20 s, one evaluation went unanswered there)."""
  import threading
  import time
  from fedjax_het.flower.local import LocalDeployment
  flagfile = _flagfile(tmp_path, 'fedre')
  metrics = tmp_path / 'flower' / 'metrics.jsonl'
  with LocalDeployment(4, str(tmp_path / 'flower')) as deployment:
    with open(tmp_path / 'flwr_run.log', 'w') as log:
      done = []
      runner = threading.Thread(target=lambda: done.append(deployment.run(flagfile, round_timeout=45, stdout=log)))
      runner.start()
      while not (metrics.exists() and metrics.read_text().strip()) and runner.is_alive():
        time.sleep(0.5)
      deployment.kill_supernode(3)
      runner.join(600)
  assert done == [0], (tmp_path / 'flwr_run.log').read_text()[-3000:]
  rows = _rows(tmp_path / 'flower')
  assert [r['missing_clients'] for r in rows] == [[], [3], [3]]
  assert [r['participants'] for r in rows] == [4, 3, 3] and rows[-1]['evaluated_clients'] == 3
  assert json.loads((tmp_path / 'flower' / 'summary.json').read_text())['finished']


@pytest.mark.slow
def test_a_deployment_with_a_lying_node_and_an_impostor_finishes_without_them(tmp_path):
  """Authenticated SuperNodes on localhost: client 2's node uploads NaN and inflates its test counts
  (tests/fixtures/malicious_node), and a second node with a registered key of its own claims client 0. The
  impostor is refused, client 2's replies are left out every round, and the honest nodes' run finishes."""
  from fedjax_het.flower.local import LocalDeployment
  flagfile = _flagfile(tmp_path, 'fedre')
  fixture = os.path.join(os.path.dirname(__file__), 'fixtures', 'malicious_node')
  deployment = LocalDeployment(4, str(tmp_path / 'flower'))
  try:
    deployment.start()
    deployment.supernodes[2].kill()
    deployment.supernodes[2].wait()
    deployment.start_supernode(2, env={'PYTHONPATH': os.pathsep.join([fixture, os.environ.get('PYTHONPATH', '')])})
    deployment.start_supernode(0, identity='impostor')
    with open(tmp_path / 'flwr_run.log', 'w') as log:
      status = deployment.run(flagfile, round_timeout=120, stdout=log)
  finally:
    deployment.stop()
  assert status == 0, (tmp_path / 'flwr_run.log').read_text()[-3000:]
  rows = _rows(tmp_path / 'flower')
  assert [r['rejected_clients'] for r in rows] == [[2], [2], [2]]
  assert [r.get('rejected_scores') for r in rows] == [[2], [2], [2]]
  assert [r['participants'] for r in rows] == [3, 3, 3] and all(0 <= r['accuracy'] <= 1 for r in rows)
  log = (tmp_path / 'flwr_run.log').read_text()
  assert 'claims client 0, whose registered SuperNode is' in log, log[-3000:]
  assert json.loads((tmp_path / 'flower' / 'summary.json').read_text())['finished']


@pytest.mark.slow
def test_simulation_engine_equals_the_simulation(tmp_path):
  """Flower's Simulation Engine (Ray actors as the 4 nodes) gives the in-process simulation's numbers."""
  pytest.importorskip('ray')
  _flower_equals_simulation(tmp_path, 'fedre', simulation=True)


@pytest.mark.slow
def test_the_local_command_applies_flags_after_the_flagfile(tmp_path):
  """python -m fedjax_het.flower.local with --rounds=2 --num_clients=3 after a flag file of 3 rounds and 4
  clients: 3 SuperNodes, 2 rounds."""
  import subprocess
  import sys
  flagfile = _flagfile(tmp_path, 'fedre')
  result = subprocess.run([sys.executable, '-m', 'fedjax_het.flower.local', f'--flagfile={flagfile}',
                           f'--workdir={tmp_path / "run"}', '--rounds=2', '--num_clients=3', '--round_timeout=300'],
                          capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  assert '3 SuperNodes' in result.stdout and 'round 2/2: 3 clients evaluated' in result.stdout, result.stdout[-3000:]
  rows = _rows(tmp_path / 'run')
  assert [r['round'] for r in rows] == [1, 2] and rows[-1]['evaluated_clients'] == 3


def test_flowers_commands_are_found_beside_this_python_when_not_on_path(monkeypatch, tmp_path):
  """A virtual environment run by its path, not activated: its Flower commands are not on PATH (the local command
  once said "flwr is not installed"); they are found beside the Python and put first on PATH."""
  from fedjax_het.flower import local
  here = os.path.dirname(local.sys.executable)
  monkeypatch.setenv('PATH', str(tmp_path))
  monkeypatch.setattr(local.sys, 'executable', os.path.join(here, 'python'))
  if not os.path.exists(os.path.join(here, 'flower-superlink')):
    pytest.skip('Flower\'s commands are not installed beside this Python')
  local.find_flower_commands()
  assert os.environ['PATH'].split(os.pathsep)[0] == here
  monkeypatch.setenv('PATH', str(tmp_path))
  monkeypatch.setattr(local.sys, 'executable', str(tmp_path / 'python'))
  with pytest.raises(ConfigError, match=r'flwr is installed, but its commands .* Fix: put the folder'):
    local.find_flower_commands()


def test_paths_with_quotes_and_spaces_cross_flowers_run_config_whole():
  from flwr.common.config import parse_config_args
  from fedjax_het.flower.run_config import run_config_argument
  config = {'workdir': '/tmp/my "best" run', 'state-dir': "/data/it's here", 'flagfile': r'C:\flags\a b.flags',
            'rounds': 3, 'resume': True}
  assert parse_config_args([run_config_argument(config)]) == config
  with pytest.raises(ConfigError, match=r"holds both ' and \", which no value of Flower's --run-config can carry"):
    run_config_argument({'workdir': '/tmp/it\'s "x"'})


def test_stopping_the_deployment_stops_what_its_processes_started_even_in_other_sessions(tmp_path):
  """An orphaned ServerApp once held the workdir's lock for minutes after the local command ended: the deployment
  stops every process its SuperLink and SuperNodes started, in whatever session."""
  import subprocess
  import sys
  import time
  from fedjax_het.flower.local import _stop, descendants
  child = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import os, time; "
           f"open(r\"{tmp_path}/grandchild\", \"w\").write(str(os.getpid())); time.sleep(120)'], "
           f"start_new_session=True); time.sleep(120)")
  parent = subprocess.Popen([sys.executable, '-c', child], start_new_session=True)
  marker = tmp_path / 'grandchild'
  deadline = time.monotonic() + 30
  while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
    time.sleep(0.05)
  grandchild = int(marker.read_text())
  assert grandchild in descendants([parent.pid])
  _stop([parent], grace=2.0)
  time.sleep(0.2)
  state = open(f'/proc/{grandchild}/stat').read().split()[2] if os.path.exists(f'/proc/{grandchild}') else 'gone'
  assert state in ('gone', 'Z'), state


def test_a_run_that_did_not_finish_is_a_failure_of_the_local_command(tmp_path):
  from fedjax_het.flower.local import unfinished
  summary = tmp_path / 'summary.json'
  assert unfinished(str(summary), None) == ('the ServerApp ended without writing summary.json (its output above '
                                            'says why)')
  summary.write_text(json.dumps({'finished': True}))
  before = os.path.getmtime(summary)
  assert unfinished(str(summary), before).startswith('the ServerApp ended without writing')  # an earlier run's
  assert unfinished(str(summary), None) is None
  summary.write_text(json.dumps({'finished': False, 'diverged_round': 3}))
  assert unfinished(str(summary), None) == 'training diverged in round 3 (summary.json)'
  summary.write_text(json.dumps({'finished': False, 'rounds': 2}))
  assert unfinished(str(summary), None) == 'the run stopped after round 2 without finishing (summary.json)'


@pytest.mark.slow
def test_poisson_rounds_over_flower_equal_the_simulation_empty_rounds_and_fixed_denominator_included(tmp_path):
  """An amplified DP run under Poisson sampling (LG-FedAvg, central, seeded noise): the draw takes nobody in some
  round, which the server still noises and releases; the Flower server's rows equal the simulation's."""
  cfg = dataclasses.replace(CFG, algorithm='lg_fedavg', participation='poisson', join_ratio=0.3, rounds=4,
                            dp_mode='central', dp_noise_multiplier=2.0, dp_reproducible_noise=True)
  from fedjax_het.run.experiment import build_federation_and_budget
  fed, _ = build_federation_and_budget(cfg)
  assert 0 in [len(fed.participants(r)) for r in range(4)]
  train_and_evaluate(cfg, str(tmp_path / 'flower'), progress=False, federation=lambda fed: FlowerRounds(
      fed, InProcessGrid(str(tmp_path / 'nodes'), 4), json.dumps(cfg.to_dict()), round_timeout=5, connect_timeout=5))
  train_and_evaluate(cfg, str(tmp_path / 'simulation'), progress=False)
  flower, simulation = _rows(tmp_path / 'flower'), _rows(tmp_path / 'simulation')
  assert len(flower) == len(simulation) == 4
  for a, b in zip(flower, simulation):
    assert 'participants' not in a and 'evaluated_clients' not in a  # withheld under DP
    assert {k: a[k] for k in b if 'seconds' not in k} == {k: v for k, v in b.items() if 'seconds' not in k}
