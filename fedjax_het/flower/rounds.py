"""The server's rounds over a Flower `Grid`: what the simulation's executor does in-process, done by the nodes.

`FlowerRounds` stands in for a `Federation` in `experiment.train_and_evaluate`: it samples the same participants,
sends each what it reads of its group's broadcast (a TRAIN message), lays the uploads that come back in the
simulation's slots and hands them to the same `Federation.finish_round` (server step, communication counts,
metrics; `participants` counts the clients whose upload was taken, `drawn` those the round drew); `evaluate` asks
every node for its scores (EVALUATE messages) and reduces them as the simulation does.
With every reply in, its numbers are the simulation's.

A node that does not answer within `round_timeout` seconds (it died, it lost its connection) or answers with an
error is left out of that round as if it had not been drawn: the method's masks already handle an absent
participant, so the round goes on with the replies it has, and the row of metrics lists the clients missing. A
round in which no participant answers, or an evaluation no node answers, stops the run with an error that says
to --resume from the last checkpoint once the nodes are back.

The server trusts no reply (`check_upload`, `check_scores`): an upload must hold exactly the arrays of the
method's upload, each of its shape and dtype, finite and within `upload_bound` in absolute value; the loss a
finite number; an evaluation's test rows those the server's own split gives the client, and its correct
predictions integers between 0 and them. A reply that fails is logged with its client and node and left out as
a missing one would be ('rejected_clients' in the round's metrics): it never reaches the server step or a
metric, and never ends the run.

Every TRAIN and EVALUATE message carries its round, a token the server draws as it starts (the run's identity
for the nodes) and the round after which its client's state is the one to start from: its 'state-round', the
last round whose upload from that client the server took (`node.NodeStates.settle`), so that a node's state
moves on only for a reply the server took. A reply must carry back the round and the token of its message
(`check_binding`): a reply of another round or run, a stale or a replayed one, is rejected as any other bad
reply. Which uploads the server took is written to the workdir each round (`LEDGER`), so that a server that
resumes from a checkpoint tells the nodes the states that belong to it.

Under DP (`--dp_mode`) a node's TRAIN reply holds its upload alone, and under local DP its EVALUATE reply holds
nothing (the server is not trusted with anything of the client beyond its noised uploads, so such a run writes no
accuracy); the server's log lines say that a round trained or an evaluation ended, with no client, count, loss or
timing, and its rows go through the release rule of every DP run (`run.experiment.released_metrics`).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode

from fedjax_het.core import for_client, has_per_client
from fedjax_het.engine.federation import Federation, FederationState, GroupRound
from fedjax_het.engine.groups import slot_indices
from fedjax_het.errors import ConfigError
from fedjax_het.flower.records import tree_from_record, tree_to_record
from fedjax_het.run.workdir import write_atomically


class NodesUnavailable(ConfigError):
  """Too few nodes answered for the run to go on."""


class ReplyRejected(ValueError):
  """A node's reply that the server does not take; the message says why."""


UPLOAD_BOUND = 1e6  # the largest absolute value an upload's array may hold (run config: upload-bound)
LEDGER = 'flower_taken.json'  # in the workdir: {round (1-based): the clients whose upload the server took}


def check_upload(content: RecordDict, template: Any, bound: float, with_loss: bool = True) -> tuple[Any, float]:
  """(upload in `template`'s structure, loss) of a TRAIN reply's content, or ReplyRejected saying what is wrong:
  missing parts, other arrays than the template's (count, shape, dtype), NaN or infinite values or values beyond
  `bound` in absolute value in a floating-point array, a loss that is not a finite number. Without `with_loss` (a DP
  run, whose nodes send their upload alone) no loss is read, and 0.0 stands for it."""
  try:
    record, loss = content['upload'], (content['metrics']['loss'] if with_loss else 0.0)
  except (KeyError, TypeError) as e:
    raise ReplyRejected(f'no {e} in the reply') from None
  expected = jax.tree.structure(template).num_leaves
  if len(record) != expected:
    raise ReplyRejected(f'{len(record)} arrays where the upload has {expected}')
  try:
    upload = tree_from_record(record, template, 'the upload')
  except ConfigError as e:
    raise ReplyRejected(str(e).split(' Fix:')[0]) from None
  for i, leaf in enumerate(jax.tree.leaves(upload)):
    if np.issubdtype(leaf.dtype, np.inexact):  # (integer arrays are counts, ids or keys: their shape is checked)
      values = np.asarray(leaf, np.float64)
      if not np.all(np.isfinite(values)):
        raise ReplyRejected(f'array {i} holds NaN or infinite values')
      if values.size and np.abs(values).max() > bound:
        raise ReplyRejected(f'array {i} holds {np.abs(values).max():.4g}, beyond the bound {bound:g} '
                            f'(run config upload-bound)')
  if not isinstance(loss, (int, float)) or not np.isfinite(loss):
    raise ReplyRejected(f'the loss {loss!r} is not a finite number')
  return upload, float(loss)


def check_scores(scores: Any, which: str, rows: int, predictions: int) -> np.ndarray:
  """The correct predictions [predictions] of an EVALUATE reply's scores on the `which` test set, whose test rows
  must be `rows` (the server's own count for that client), or ReplyRejected."""
  try:
    correct, reported = scores[f'{which}_correct'], scores[f'{which}_rows']
  except (KeyError, TypeError) as e:
    raise ReplyRejected(f'no {e} in the scores') from None
  if reported != rows:
    raise ReplyRejected(f'{reported!r} {which} test rows where the client has {rows}')
  correct = np.asarray(correct)
  if correct.shape != (predictions,) or not np.issubdtype(correct.dtype, np.integer):
    raise ReplyRejected(f'{which} correct predictions {correct.tolist()!r}: expected {predictions} integers')
  if correct.min(initial=0) < 0 or correct.max(initial=0) > rows:
    raise ReplyRejected(f'{which} correct predictions {correct.tolist()} outside 0..{rows}')
  return correct


def check_binding(content: RecordDict, round_index: int, run: str) -> None:
  """ReplyRejected unless a reply's content carries back the round and the run token of the message it answers
  (`client_app.bind_reply`): a reply of another round or run (stale, or replayed) is refused."""
  try:
    bound = content['reply']
    got_round, got_run = int(bound['round']), str(bound['run'])
  except (KeyError, TypeError, ValueError):
    raise ReplyRejected('the reply does not say which round and run it answers') from None
  if (got_round, got_run) != (round_index, run):
    what = 'another run\'s' if got_run != run else f'round {got_round + 1}\'s'
    raise ReplyRejected(f'the reply is {what}, not this run\'s round {round_index + 1} (stale or replayed)')


def message_config(cfg_json: str, round_index: int, **extra) -> ConfigRecord:
  """The ConfigRecord every message carries: the run's config (each node rebuilds the run from it) and the round."""
  return ConfigRecord({'experiment': cfg_json, 'round': round_index, **extra})


class FlowerRounds:
  """A `Federation` whose participants are Flower nodes: `init`, `round` and `evaluate` go through `grid`; every
  other attribute is the federation's (`fed`, built from the same config as the nodes build theirs).

  cfg_json: the run's `ExperimentConfig` as JSON; round_timeout: seconds a round waits for its replies;
  connect_timeout: seconds the first round waits for the nodes to connect (`assign_nodes`); log: called with a
  line as each round's training and each evaluation ends (how long it took), or None; upload_bound: the largest
  absolute value an upload may hold (`check_upload`); registered: client id -> the node id of its registered
  SuperNode key, where the deployment authenticates nodes (`assign_nodes` takes no other node's claim); workdir:
  the run's folder, where the record of the uploads the server took is kept (`LEDGER`; None: in memory only, and
  such a server cannot resume); progress: called with a line as the run waits for something that takes long (the
  nodes to connect, the first round's and the first evaluation's replies, while every node starts its ClientApp
  and compiles its programs), or None; under DP its lines name no client and count nothing."""

  def __init__(self, fed: Federation, grid, cfg_json: str, round_timeout: float, connect_timeout: float,
               log: Optional[Callable[[str], None]] = None, upload_bound: float = UPLOAD_BOUND,
               registered: Optional[dict[int, int]] = None, workdir: Optional[str] = None,
               progress: Optional[Callable[[str], None]] = None):
    if any(e.statistics is not None for e in fed.evaluations):
      heterofl = fed.algorithm.name == 'heterofl'
      instead = ' --noheterofl_static_bn (each test batch\'s statistics), or' if heterofl else ''
      raise ConfigError(f'{fed.algorithm.name}: its evaluation gathers statistics over every client\'s training '
                        f'rows (HeteroFL\'s static BatchNorm), which the nodes are not asked for over Flower. Fix:'
                        f'{instead} run the simulation.')
    self.fed, self.grid, self.cfg_json = fed, grid, cfg_json
    self.round_timeout, self.connect_timeout, self.log = round_timeout, connect_timeout, log
    self.progress = progress or (lambda line: None)
    self._waited: set = set()  # the message types whose first replies were announced (`_announce`)
    self.upload_bound, self.registered = upload_bound, registered
    self.nodes: Optional[dict[int, int]] = None  # client id -> node id, asked as the first round starts
    self.workdir = workdir
    self.run_token = secrets.token_hex(16)  # every reply carries it back (`check_binding`)
    self.taken: Optional[dict[int, list[int]]] = None  # round (1-based) -> the clients whose upload was taken
    # Under DP the nodes send their uploads alone, and the server's log lines name no client, count no participant
    # and time no round (the release rule of the rows, `run.experiment.released_metrics`).
    self.dp_mode = json.loads(cfg_json).get('dp_mode', 'off')
    self._templates: dict = {}
    self._initial_groups = None

  def _connect(self, round_index: int) -> None:
    if self.taken is None:
      self.taken = self._read_ledger(round_index)
    if self.nodes is None:
      self.progress(f'waiting for the SuperNodes of the {self.fed.num_clients} clients to connect (at most '
                    f'{self.connect_timeout:g} s, connect-timeout)')
      self.nodes = assign_nodes(self.grid, self.fed, self.cfg_json, round_index, self.connect_timeout,
                                registered=self.registered)
      self.progress(f'{len(self.nodes)} SuperNodes connected, one per client')

  def _announce(self, kind: str, round_index: int, count: int) -> None:
    """Says, the first time the run sends messages of `kind` (TRAIN, EVALUATE), what the wait for their replies
    holds: every node starts a ClientApp process, which builds its client and compiles its programs."""
    if kind in self._waited:
      return
    self._waited.add(kind)
    what = 'training' if kind == MessageType.TRAIN else 'evaluating'
    on = '' if self.dp_mode != 'off' else f' on {count} nodes'
    self.progress(f'round {round_index + 1}/{self.fed.total_rounds}: {what}{on}; each node starts a ClientApp '
                  f'process that builds its client and compiles its programs (the first time waits longest)')

  def _read_ledger(self, start_round: int) -> dict[int, list[int]]:
    """The uploads taken in the rounds up to `start_round` (the round the run starts from), as the workdir's
    `LEDGER` records them; a ConfigError where a resumed run has no record (the nodes could not be told which state
    to start from)."""
    path = os.path.join(self.workdir, LEDGER) if self.workdir else None
    if start_round == 0:
      return {}
    try:
      with open(path) as f:
        taken = {int(r): [int(k) for k in clients] for r, clients in json.load(f).items()}
    except (OSError, TypeError, ValueError, AttributeError):
      raise ConfigError(f'the Flower server resumes from round {start_round} without a readable record of the '
                        f'uploads it took ({path or "no workdir given"}), so it cannot tell the nodes which state to '
                        f'start from. Fix: resume with the workdir the run wrote (FlowerRounds(workdir=...)), or start '
                        f'the run again.') from None
    return {r: clients for r, clients in taken.items() if r <= start_round}

  def _write_ledger(self) -> None:
    if self.workdir:
      write_atomically(os.path.join(self.workdir, LEDGER), lambda f: json.dump(
          {str(r): clients for r, clients in sorted(self.taken.items())}, f))

  def state_round(self, k: int) -> int:
    """The last round (1-based) whose upload from client k the server took, 0 for none: the state it starts
    from."""
    return max((r for r, clients in (self.taken or {}).items() if k in clients), default=0)

  def __getattr__(self, name: str) -> Any:
    return getattr(self.fed, name)

  def init(self) -> FederationState:
    """The initial server state; the client states live on the nodes (no groups here)."""
    state = self.fed.init()
    self._initial_groups = state.groups
    return FederationState((), state.server, state.round)

  def _messages(self, clients, broadcasts: list, round_index: int, message_type: str) -> list[Message]:
    """One message per client: what it reads of its group's broadcast (`for_client`: its own slice of a
    `PerClient` part, never the others') and the run's config."""
    by_group = {}

    def record(k: int):
      gi = int(self.fed.group_of[k])
      b = broadcasts[gi]
      if has_per_client(b):
        return tree_to_record(for_client(b, int(np.flatnonzero(self.fed.groups[gi].clients == k)[0])))
      if gi not in by_group:
        by_group[gi] = tree_to_record(b)
      return by_group[gi]
    return [Message(RecordDict({'broadcast': record(k), 'config': message_config(
        self.cfg_json, round_index, **{'run': self.run_token, 'state-round': self.state_round(k)})}),
                    dst_node_id=self.nodes[k], message_type=message_type) for k in clients]

  def _send(self, messages: list[Message]) -> dict[int, Message]:
    """Replies by client id of the messages that came back without an error within the timeout."""
    by_node = {node: k for k, node in self.nodes.items()}
    replies = self.grid.send_and_receive(messages, timeout=self.round_timeout)
    out = {}
    for reply in replies:
      k = by_node.get(reply.metadata.src_node_id)
      if k is None:
        continue
      if reply.has_error():
        if self.dp_mode == 'off':
          logging.warning('client %d (node %d) replied with an error: %s', k, reply.metadata.src_node_id,
                          reply.error.reason)
        continue
      out[k] = reply
    return out

  def _upload_template(self, gi: int, p: int, broadcast: Any) -> Any:
    key = (gi, p)
    if key not in self._templates:
      g = self.fed.groups[gi]
      stacked = self._initial_groups[gi] if self._initial_groups is not None else self.fed.init_group(gi)
      self._templates[key] = self.fed.executor.empty_upload(g, self.fed.programs[p][gi], p, stacked, broadcast)
    return self._templates[key]

  def round(self, state: FederationState) -> tuple[FederationState, dict]:
    """One round: TRAIN messages to the participants, their uploads (each checked, `check_upload`) into the
    simulation's slots, `Federation.finish_round`. Metrics as the simulation's, plus 'missing_clients' (no upload
    taken) and 'rejected_clients' (an upload that failed its check)."""
    start = time.perf_counter()
    fed, r = self.fed, int(state.round)
    self._connect(r)
    p = fed.phase_index(r)
    participants = fed.participants(r)
    if not len(participants) and not fed.phase(r).runs_without_participants:
      new_state, metrics = fed.empty_round(state, start)
      if self.log is not None and self.dp_mode != 'off':  # the same line as every other round's
        self.log(f'round {r + 1}/{fed.total_rounds}: trained')
      return new_state._replace(groups=()), {**metrics, 'missing_clients': [], 'rejected_clients': [], 'drawn': 0}
    broadcasts = [fed.sent(state.server, gi, r) for gi in range(len(fed.groups))]
    self._announce(MessageType.TRAIN, r, len(participants))
    replies = self._send(self._messages(participants.tolist(), broadcasts, r, MessageType.TRAIN))
    taken, rejected = {}, []
    for k, reply in sorted(replies.items()):
      gi = int(fed.group_of[k])
      template = self._upload_template(gi, p, for_client(fed.received(broadcasts[gi], r), 0))
      try:
        check_binding(reply.content, r, self.run_token)
        taken[k] = check_upload(reply.content, template, self.upload_bound, with_loss=self.dp_mode == 'off')
      except ReplyRejected as e:
        if self.dp_mode == 'off':
          logging.warning('round %d: the upload of client %d (node %d) is left out: %s.', r + 1, k,
                          reply.metadata.src_node_id, e)
        rejected.append(k)
    missing = sorted(set(participants.tolist()) - set(taken))
    if missing and self.dp_mode == 'off':
      logging.warning('round %d: clients %s did not answer or were left out; the round goes on without them.',
                      r + 1, missing)
    if not taken and len(participants):
      if self.dp_mode != 'off':
        raise NodesUnavailable(f'round {r + 1}: no participant answered within {self.round_timeout:g} s with an '
                               f'upload the server takes. Fix: bring the nodes back (or raise round-timeout), then '
                               f'run again with resume=true to continue from the last checkpoint.')
      raise NodesUnavailable(f'round {r + 1}: none of the {len(participants)} participants answered within '
                             f'{self.round_timeout:g} s with an upload the server takes ({len(rejected)} left out). '
                             f'Fix: bring the nodes back (or raise round-timeout), then run again with resume=true '
                             f'to continue from the last checkpoint.')
    answered = np.asarray(sorted(taken))
    results = []
    for gi, (g, slots) in enumerate(zip(fed.groups, fed.slots(r))):
      slot_idx = slot_indices(g, answered, slots)
      template = self._upload_template(gi, p, for_client(fed.received(broadcasts[gi], r), 0))
      uploads, losses = [], []
      for i in slot_idx.tolist():
        upload, loss = taken[int(g.clients[i])] if i < g.size else (template, 0.0)
        uploads.append(upload)
        losses.append(loss)
      stacked = jax.tree.map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *uploads)
      results.append(GroupRound(slot_idx, None, stacked, jnp.asarray(losses, jnp.float32)))
    new_state, metrics = fed.finish_round(state, results, answered, start)
    metrics['missing_clients'], metrics['rejected_clients'] = missing, rejected
    self.taken[r + 1] = sorted(taken)  # the nodes' states move on for these uploads alone
    self._write_ledger()
    metrics['drawn'] = len(participants)  # what a resumed run's accounting draws again (`PrivacyBudget.after`)
    if self.log is not None and self.dp_mode != 'off':
      self.log(f'round {r + 1}/{fed.total_rounds}: trained')
    elif self.log is not None:
      self.log(f'round {r + 1}/{fed.total_rounds}: {len(answered)} clients trained in '
               f'{time.perf_counter() - start:.1f} s'
               + (f', train_loss {float(metrics["train_loss"]):.4f}' if 'train_loss' in metrics else '')
               + (f', missing clients {missing}' if missing else ''))
    return new_state._replace(groups=()), metrics

  def evaluate(self, state: FederationState) -> dict:
    """The simulation's `evaluate` from every node's scores (EVALUATE messages, each checked, `check_scores`);
    nodes that do not answer, or whose scores fail their check ('rejected_scores'), are left out."""
    fed = self.fed
    start = time.perf_counter()
    r = max(int(state.round) - 1, 0)
    if self.dp_mode == 'local':  # the nodes send nothing of their data but their noised uploads
      if self.log is not None:
        self.log(f'round {r + 1}/{fed.total_rounds}: no evaluation (under local DP the nodes send no scores)')
      return {}
    self._connect(int(state.round))
    broadcasts = [fed.sent(state.server, gi, r) for gi in range(len(fed.groups))]
    self._announce(MessageType.EVALUATE, r, fed.num_clients)
    replies = self._send(self._messages(range(fed.num_clients), broadcasts, r, MessageType.EVALUATE))
    names = fed.evaluations[0].names
    expected = {}  # which -> the test rows the server's own split gives each client
    for which in ('local', 'global'):
      if which == 'local' and fed.has_local_test:
        expected[which] = {int(k): int(g.test.sizes[g.test.index(i)]) for g in fed.groups
                           for i, k in enumerate(g.clients)}
      elif which == 'global' and fed.global_test is not None:
        expected[which] = {int(k): int(fed.global_test.sizes[fed.global_test.index(i)]) for g in fed.groups
                           for i, k in enumerate(g.clients)}
    scored, rejected = {}, []
    for k, reply in sorted(replies.items()):
      try:
        check_binding(reply.content, r, self.run_token)
        scores = reply.content['metrics']
        scored[k] = {which: check_scores(scores, which, rows[k], len(names)) for which, rows in expected.items()}
      except (ReplyRejected, KeyError) as e:
        if self.dp_mode == 'off':
          logging.warning('the evaluation after round %d: the scores of client %d (node %d) are left out: %s.',
                          r + 1, k, reply.metadata.src_node_id, e)
        rejected.append(k)
    if not scored:
      raise NodesUnavailable(f'the evaluation after round {r + 1}: no node answered within {self.round_timeout:g} s '
                             f'with scores the server takes ({len(rejected)} left out). Fix: bring the nodes back, '
                             f'then run again with resume=true.')
    sets = {'local': None, 'global': None}
    for which, rows in expected.items():
      correct, counts = np.zeros((fed.num_clients, len(names))), np.zeros(fed.num_clients)
      for k, per_set in scored.items():
        correct[k], counts[k] = per_set[which], rows[k]
      sets[which] = (correct, counts)
    out = fed.accuracy(sets['local'], sets['global'])
    out['evaluated_clients'] = len(scored)
    primary = 'global' if fed.data.protocol == 'global' else 'local'
    if primary in expected and self.dp_mode == 'off':  # beside the per-client scores, an aggregate one node moves
      # by one rank at most (not under DP: a median is one client's accuracy, `experiment.PER_CLIENT_EVALUATION`)
      rows = expected[primary]
      out['client_accuracy_median'] = float(np.median([scored[k][primary][0] / rows[k] for k in scored if rows[k]]))
    out.update(self.server_scores(state))
    if rejected:
      out['rejected_scores'] = rejected
    if self.log is not None and self.dp_mode != 'off':
      self.log(f'round {r + 1}/{fed.total_rounds}: evaluated, accuracy {float(out["accuracy"]):.4f}')
    elif self.log is not None:
      accuracy = f', accuracy {float(out["accuracy"]):.4f}' if 'accuracy' in out else ''
      self.log(f'round {r + 1}/{fed.total_rounds}: {len(scored)} clients evaluated in '
               f'{time.perf_counter() - start:.1f} s{accuracy}')
    return out

  def scores_server_model(self) -> bool:
    """Whether the server can score the model it holds itself: the method scores each client with the model the
    server broadcasts (`Capabilities.server_model_evaluation`), and no group's model keeps BatchNorm statistics,
    which stay on the nodes."""
    return (self.fed.algorithm.capabilities.server_model_evaluation and self._initial_groups is not None
            and not any(jax.tree.leaves(g.model_state) for g in self._initial_groups))

  def server_scores(self, state: FederationState) -> dict:
    """Where `scores_server_model`, the server's own evaluation of the model it holds on every client's test rows
    of its copy of the seeded split ('server_accuracy', 'server_client_accuracy_mean', ...), which no node's reply
    reaches; {} elsewhere."""
    if not self.scores_server_model():
      return {}
    own = self.fed.evaluate(FederationState(self._initial_groups, state.server, state.round))
    return {f'server_{k}': v for k, v in own.items() if isinstance(v, float)}


# Errors of a QUERY that never reached a node's ClientApp (a node restarting, a message lost): the node is asked
# again at the next poll, while a ClientApp's own refusal (its DP policy, say) stands.
_NOT_DELIVERED = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE,
                  ErrorCode.UNKNOWN)


def assign_nodes(grid, fed: Federation, cfg_json: str, start_round: int, connect_timeout: float,
                 poll_seconds: float = 1.0, registered: Optional[dict[int, int]] = None) -> dict[int, int]:
  """client id -> node id: asks each connected node which client it holds (a QUERY message; the node also forgets
  states after `start_round`), as nodes connect, until every client has its node (at most `connect_timeout` s).

  A node's claim is refused, with a warning naming it, where `registered` (client -> the node id of the key
  registered for it, in an authenticated deployment) gives that client another node, where another node claimed
  the client first, where it names no client of the run, or where the node answers with an error (its reason is
  logged, e.g. its DP policy): no node can block the run by claiming a client. NodesUnavailable when clients are
  still without a node at the deadline."""
  deadline = time.monotonic() + connect_timeout
  config = message_config(cfg_json, start_round)
  nodes: dict[int, int] = {}
  settled: set = set()  # nodes whose answer was taken or refused; the others are asked again
  waiting: dict[int, str] = {}  # node -> why it gave no answer yet (no reply, or its message did not reach it)
  refusals: list[str] = []
  while True:
    new = [n for n in grid.get_node_ids() if n not in settled]
    if registered is not None:
      new = sorted(new, key=lambda n: n not in registered.values())  # the registered nodes' answers first
    if new:
      messages = [Message(RecordDict({'config': config}), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
      answered = set()
      for reply in grid.send_and_receive(messages, timeout=max(deadline - time.monotonic(), poll_seconds)):
        node = reply.metadata.src_node_id
        answered.add(node)
        if reply.has_error() and reply.error.code in _NOT_DELIVERED:
          waiting[node] = reply.error.reason or 'its message was not delivered'
          continue
        settled.add(node)
        waiting.pop(node, None)
        why = _claim(reply, nodes, registered, fed.num_clients)
        if why:
          refusals.append(why)
          logging.warning('%s', why)
      for node in set(new) - answered:
        waiting.setdefault(node, 'no reply')
    if len(nodes) == fed.num_clients or time.monotonic() >= deadline:
      break
    time.sleep(poll_seconds)
  absent = sorted(set(range(fed.num_clients)) - set(nodes))
  if absent:
    said = f' Refused: {"; ".join(refusals[:5])}.' if refusals else ''
    quiet = (f' Not answering: {"; ".join(f"SuperNode {n} ({why})" for n, why in sorted(waiting.items())[:5])}.'
             if waiting else '')
    raise NodesUnavailable(f'no SuperNode holds clients {absent} after {connect_timeout:g} s '
                           f'({len(settled) + len(waiting)} connected).{said}{quiet} Fix: start a SuperNode with --node-config "partition-id=K" for each of '
                           f'them (or raise connect-timeout).')
  logging.info('nodes by client: %s', json.dumps(nodes))
  return nodes


def _claim(reply: Message, nodes: dict[int, int], registered: Optional[dict[int, int]], num_clients: int
           ) -> Optional[str]:
  """Takes a node's answer to the QUERY into `nodes`; why it was refused, or None."""
  node = reply.metadata.src_node_id
  if reply.has_error():
    return f'SuperNode {node} could not join the run: {reply.error.reason}'
  try:
    k = int(reply.content['node']['client'])
  except (KeyError, TypeError, ValueError):
    return f'SuperNode {node} answered without the client it holds'
  if not 0 <= k < num_clients:
    return f'SuperNode {node} claims client {k}, which the run does not have ({num_clients} clients)'
  if registered is not None and registered.get(k) != node:
    return (f'SuperNode {node} claims client {k}, whose registered SuperNode is {registered.get(k)}: refused')
  if k in nodes:
    return f'SuperNode {node} claims client {k}, which SuperNode {nodes[k]} holds: refused'
  nodes[k] = node
  return None
