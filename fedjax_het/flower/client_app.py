"""The ClientApp: a SuperNode's client of a fedjax_het run (`Node`), chosen by the node's config.

  flower-supernode --insecure --superlink HOST:PORT --node-config 'partition-id=3 state-dir="/data/fedjax_het"'

partition-id: the client this node holds (its partition of the seeded split, its architecture); architecture
(optional): the architecture the node expects, checked against the run's; state-dir: where
its client state lives between rounds (default: the run config's state-dir, which Flower's Simulation Engine
uses, else a folder under the system's temporary directory); data-dir: the
tfds data_dir on this machine, when it differs from the run's --data_dir; compilation-cache: XLA's persistent
compilation cache (default ~/.cache/fedjax_het/xla; every message runs in a new ClientApp process, which reads
its compiled programs there instead of compiling them again).

The node's own privacy policy, which no config from the server overrides (`check_dp_policy`): dp-mode="local"
makes the node train only in runs that noise each client's upload on the client (--dp_mode=local), with at least
dp-noise-multiplier (sigma, as the run calibrates it) and, where dp-max-epsilon is set, spending at most that epsilon
over the run (at the run's --dp_delta); any other run's messages are answered with an error that says why, and the
server leaves the node out.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedjax_het.errors import ConfigError
from fedjax_het.flower.node import Node, deployed_config
from fedjax_het.flower.records import tree_from_record, tree_to_record
from fedjax_het.flower.run_config import run_name
from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.experiment import build_federation_and_budget



def bind_reply(message: Message, context: Context, call_next) -> Message:
  """A ClientApp mod: every reply to a TRAIN or EVALUATE message carries the round and the run token of the
  message it answers ('reply': {'round', 'run'}), which the server checks (`rounds.check_binding`), so that a reply
  of another round or run (a stale or replayed one) is refused."""
  reply = call_next(message, context)
  config = message.content['config'] if 'config' in message.content else None
  if config is not None and not reply.has_error():
    reply.content['reply'] = ConfigRecord({'round': int(config['round']), 'run': str(config.get('run', ''))})
  return reply


def state_round(message: Message) -> int:
  """The server's word in a TRAIN or EVALUATE message: the round after which the client's state is the one to
  start from (the last round whose upload from it the server took; 0: its initial state), `node.NodeStates.settle`."""
  config = message.content['config']
  if 'state-round' not in config:
    raise ConfigError('the server\'s message says nothing of the state this client starts from (no state-round): '
                      'it runs another fedjax_het version. Fix: run the server and every node with the same '
                      'fedjax_het version.')
  return int(config['state-round'])


app = ClientApp(mods=[bind_reply])
# The run's federation by (config, data dir): a process that serves several messages (several nodes in one process,
# as the tests deliver them) builds it once.
_federations: dict = {}
_nodes: dict = {}  # (client, state folder) -> Node of the federation in _federations


def check_dp_policy(node_config, cfg: ExperimentConfig, budget) -> None:
  """A ConfigError where the run (`cfg`, its privacy `budget`) would have this node upload less private than its
  node config's policy allows (see the module docstring); nothing without a policy."""
  policy = node_config.get('dp-mode')
  if not policy:
    return
  if policy != 'local':
    raise ConfigError(f'node config dp-mode={policy!r}: a node\'s own policy can only be "local" (its uploads noised '
                      f'before they leave it). Fix: dp-mode="local", or no dp-mode.')
  needs = float(node_config.get('dp-noise-multiplier', 0.0))
  most = float(node_config.get('dp-max-epsilon', 0.0))
  if cfg.dp_mode != 'local' or budget is None:
    raise ConfigError(f'this node uploads only with local DP (its node config dp-mode="local"); the run asks for '
                      f'--dp_mode={cfg.dp_mode}. Fix: run with --dp_mode=local (and --dp_noise_multiplier >= '
                      f'{needs:g}), or start the node without that policy.')
  if budget.noise_multiplier < needs:
    raise ConfigError(f'this node uploads only with noise multiplier >= {needs:g} (its node config); the run\'s is '
                      f'{budget.noise_multiplier:.4g}. Fix: run with --dp_noise_multiplier >= {needs:g}.')
  if most > 0:
    spent = budget.epsilon(budget.schedule.total_rounds)
    if spent > most:
      raise ConfigError(f'this node uploads only in runs that spend epsilon <= {most:g} (its node config '
                        f'dp-max-epsilon); this run spends {spent:.4g} at delta {budget.delta:g}. Fix: more noise '
                        f'(--dp_noise_multiplier), fewer rounds or a --dp_target_epsilon <= {most:g}.')


def node_of(message: Message, context: Context) -> tuple[Node, int]:
  """This node's `Node` for the run the message belongs to, and the message's round."""
  config = message.content['config']
  node_config = context.node_config
  if 'partition-id' not in node_config:
    raise ConfigError('this SuperNode has no partition-id. Fix: start it with --node-config "partition-id=K" (K: '
                      'the client it holds).')
  use_compilation_cache(str(node_config.get('compilation-cache', DEFAULT_DIRECTORY)))
  data_dir = node_config.get('data-dir')
  key = (config['experiment'], data_dir)
  if key not in _federations:
    cfg = ExperimentConfig.from_dict(json.loads(config['experiment']))
    if data_dir:
      cfg = dataclasses.replace(cfg, data_dir=str(data_dir))
    _federations.clear()
    _federations[key] = build_federation_and_budget(deployed_config(cfg)) + (cfg,)
    _nodes.clear()
  fed, budget, cfg = _federations[key]
  check_dp_policy(node_config, cfg, budget)
  state_dir = str(node_config.get('state-dir') or context.run_config.get('state-dir')
                  or os.path.join(tempfile.gettempdir(), 'fedjax_het_flower'))
  run_dir = os.path.join(state_dir, f'run_{run_name(context.run_config.get("run-name", "default"))}')
  client = int(node_config['partition-id'])
  if (client, run_dir) not in _nodes:
    _nodes[(client, run_dir)] = Node(fed, client, run_dir)
  node = _nodes[(client, run_dir)]
  node.dp_mode = cfg.dp_mode if budget is not None else 'off'  # what its replies may carry (`train`, `evaluate`)
  if node_config.get('architecture') and node_config['architecture'] != node.architecture:
    raise ConfigError(f'node config architecture={node_config["architecture"]!r}: client {client} of this run has '
                      f'{node.architecture!r} (the flags\' --models, client k taking models[k % len(models)]). Fix: '
                      f'the partition-id of a client of that architecture, or no architecture in the node config.')
  return node, int(config['round'])


@app.query()
def query(message: Message, context: Context) -> Message:
  """Which client this node holds (and, without DP, how many training rows); forgets the states saved after the
  round the run starts from."""
  node, start_round = node_of(message, context)
  node.states.forget_after(start_round)
  held = {'client': node.client_id, 'architecture': node.architecture}
  if node.dp_mode == 'off':  # the size of its data: under DP nothing of it leaves the node
    held['num_train'] = node.num_train
  return Message(RecordDict({'node': ConfigRecord(held)}), reply_to=message)


@app.train()
def train(message: Message, context: Context) -> Message:
  """The client's round under the broadcast it received: its upload and its mean local loss; under DP its upload
alone (clipped, and noised in local mode): the loss is a function of its data that no noise covers."""
  node, r = node_of(message, context)
  broadcast = tree_from_record(message.content['broadcast'], node.broadcast_template(r), 'the broadcast')
  upload, loss = node.train(r, broadcast, state_round(message))
  if node.dp_mode != 'off':
    return Message(RecordDict({'upload': tree_to_record(upload)}), reply_to=message)
  return Message(RecordDict({'upload': tree_to_record(upload), 'metrics': MetricRecord({'loss': loss})}),
                 reply_to=message)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
  """The client's correct predictions and test rows after the round, under the evaluation's broadcast; under local
DP nothing (the server, which local DP does not trust, learns nothing of the client beyond its noised uploads)."""
  node, r = node_of(message, context)
  if node.dp_mode == 'local':
    return Message(RecordDict({'metrics': MetricRecord({})}), reply_to=message)
  broadcast = tree_from_record(message.content['broadcast'], node.broadcast_template(r), 'the broadcast')
  scores = {}
  for which, (correct, rows) in node.evaluate(r, broadcast, state_round(message)).items():
    scores[f'{which}_correct'] = [int(c) for c in correct]
    scores[f'{which}_rows'] = rows
  return Message(RecordDict({'metrics': MetricRecord(scores)}), reply_to=message)
