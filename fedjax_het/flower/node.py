"""One client on its Flower node: its partition and architecture, its state between rounds, and its program's round
and score, run by the same jitted functions as the simulation's sequential executor.

A Flower SuperNode starts a new ClientApp process for every message, so the node rebuilds its view of the run
from the run's config each time (its partition of the seeded split, its architecture group) and keeps the
client's state (model, BatchNorm statistics, optimizer states, per-client modules) in its own folder. The state
never goes to the server.

A node's state moves on only by the server's decision. A round R's training saves the new state as pending
(`pending_round_R.npz`); every TRAIN and EVALUATE message says which round's state the client starts from (its
'state-round': the last round whose upload from it the server took, 0 for none), and the node then keeps the
pending state of that round (`after_round_R.npz`) and drops any other, so a reply that came too late or was
rejected leaves the client's state as it was. The server's first message of a run (QUERY) removes the states of
rounds after the one it starts from, so a server that resumes from an earlier checkpoint finds the states that
belong to it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any, Optional

import jax
import numpy as np

from fedjax_het.core import for_client
from fedjax_het.engine.federation import Federation
from fedjax_het.engine.groups import host_copy
from fedjax_het.errors import ConfigError
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.workdir import write_atomically

_STATE_FILE = re.compile(r'after_round_(\d+)\.npz$')
_PENDING_FILE = re.compile(r'pending_round_(\d+)\.npz$')


def deployed_config(cfg: ExperimentConfig) -> ExperimentConfig:
  """The config a Flower run executes: one client per node, so the sequential executor's per-client functions on
  one device (the numbers do not depend on the executor)."""
  return dataclasses.replace(cfg, strategy='sequential', num_devices=1, chunk_size=0, memory_budget_gib=0.0,
                             stream_clients=False)


class NodeStates:
  """The folder of one client's states: one .npz of its leaves per round after which the server took its upload
  (`after_round_R.npz`), and the state of its last training while the server has not said whether it took it
  (`pending_round_R.npz`)."""

  def __init__(self, directory: str):
    self.directory = directory

  def rounds(self, pending: bool = False) -> list[int]:
    """The rounds with a kept state (or, with `pending`, a pending one), ascending."""
    pattern = _PENDING_FILE if pending else _STATE_FILE
    name = 'pending_round_*.npz' if pending else 'after_round_*.npz'
    found = (pattern.search(p) for p in glob.glob(os.path.join(self.directory, name)))
    return sorted(int(m.group(1)) for m in found if m)

  def load(self, upto_round: int, template: Any, exact: bool = False) -> Optional[Any]:
    """The newest kept state after a round <= `upto_round` (with `exact`, after that round only), in `template`'s
    structure; None when there is none."""
    saved = [r for r in self.rounds() if (r == upto_round if exact else r <= upto_round)]
    if not saved:
      return None
    with np.load(self._path(saved[-1])) as f:
      leaves = [f[f'{i:05d}'] for i in range(len(f.files))]
    treedef = jax.tree.structure(template)
    if len(leaves) != treedef.num_leaves:
      raise ConfigError(f'{self._path(saved[-1])} holds {len(leaves)} arrays where this run\'s client state has '
                        f'{treedef.num_leaves}: it belongs to another run. Fix: give each run its own node '
                        f'state-dir, or delete that folder.')
    return jax.tree.unflatten(treedef, [jax.numpy.asarray(a) for a in leaves])

  def save(self, after_round: int, state: Any, pending: bool = False) -> None:
    """Writes the state after round `after_round` atomically: kept, or pending the server's word (`settle`)."""
    os.makedirs(self.directory, exist_ok=True)
    write_atomically(self._path(after_round, pending), lambda f: np.savez(
        f, **{f'{i:05d}': np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}), binary=True)

  def settle(self, taken_round: int) -> None:
    """The server's word that the last upload it took from this client is that of round `taken_round` (0: none):
    the pending state of that round is kept, every other pending state dropped (its reply was not taken)."""
    for r in self.rounds(pending=True):
      if r == taken_round:
        os.replace(self._path(r, pending=True), self._path(r))
      else:
        os.remove(self._path(r, pending=True))

  def forget_after(self, round_index: int) -> None:
    """Removes the states, kept or pending, after rounds later than `round_index` (a run that starts over from
    there)."""
    for pending in (False, True):
      for r in self.rounds(pending):
        if r > round_index:
          os.remove(self._path(r, pending))

  def _path(self, after_round: int, pending: bool = False) -> str:
    return os.path.join(self.directory, f'{"pending" if pending else "after"}_round_{after_round:06d}.npz')


class Node:
  """Client `client_id` of the run of `fed` (`build_federation(deployed_config(cfg))`) on this node:
  `train(round, broadcast)`, `evaluate(round, broadcast)`."""

  def __init__(self, fed: Federation, client_id: int, state_dir: str):
    self.fed = fed
    if not 0 <= client_id < self.fed.num_clients:
      raise ConfigError(f'node config partition-id={client_id}: the run has {self.fed.num_clients} clients. Fix: '
                        f'partition-id between 0 and {self.fed.num_clients - 1}, one node per client.')
    self.client_id = client_id
    self.group_index = int(self.fed.group_of[client_id])
    self.group = self.fed.groups[self.group_index]
    self.index = int(np.flatnonzero(self.group.clients == client_id)[0])
    self.states = NodeStates(os.path.join(state_dir, f'client_{client_id}'))
    self._initial = None

  @property
  def architecture(self) -> str:
    return self.group.arch

  @property
  def num_train(self) -> int:
    return int(self.group.train_sizes[self.index])

  def initial_state(self) -> Any:
    """The client's initial state, as the simulation's `Federation.init` makes it."""
    if self._initial is None:
      self._initial = host_copy(self.fed.init_group(self.group_index), self.index)
    return self._initial

  def state(self, state_round: int) -> Any:
    """The client's state after round `state_round` (1-based; 0: its initial state), the last round whose upload
    the server took from it (`NodeStates.settle` has kept it); a ConfigError when this node does not hold it."""
    if state_round == 0:
      return self.initial_state()
    saved = self.states.load(state_round, self.initial_state(), exact=True)
    if saved is None:
      raise ConfigError(f'client {self.client_id}: the server took its upload of round {state_round}, and this node '
                        f'holds no state after that round in {self.states.directory} (the folder was emptied, or the '
                        f'node of that round was another). Fix: give the node back the state-dir it trained with, or '
                        f'start the run again.')
    return saved

  def broadcast_template(self, round_index: int) -> Any:
    """The structure of what the client receives in round `round_index` (its group's broadcast as it reads it)."""
    p = self.fed.phase_index(round_index)
    phase, spec = self.fed.algorithm.phases[p], self.group.spec
    return jax.eval_shape(lambda s: for_client(phase.broadcast(s, spec), self.index), self.fed.server_shapes())

  def train(self, round_index: int, broadcast: Any, state_round: int) -> tuple[Any, float]:
    """The client's round `round_index` (0-based) under `broadcast`, from its state after round `state_round` (the
    server's word, `NodeStates.settle`): (its upload, its mean local loss); its new state is saved pending."""
    self.states.settle(state_round)
    p = self.fed.phase_index(round_index)
    key, _ = self.fed.round_keys(round_index)
    program = self.fed.programs[p][self.group_index]
    client, upload, loss = self.fed.executor.run_one(self.group, program, p, self.index, self.state(state_round),
                                                     self.fed.received(broadcast, round_index), key)
    self.states.save(round_index + 1, client, pending=True)
    return upload, float(loss)

  def evaluate(self, round_index: int, broadcast: Any, state_round: int) -> dict:
    """Correct predictions and test rows of the client after round `round_index` (0-based, the evaluation's
    phase), from its state after round `state_round` (the server's word), on its local test split ('local') and on
    the global test set ('global') where they exist."""
    self.states.settle(state_round)
    p = self.fed.phase_index(round_index)
    client = self.state(state_round)
    evaluation = self.fed.evaluations[self.group_index]
    out = {}
    sets = {'local': self.group.test if self.fed.has_local_test else None, 'global': self.fed.global_test}
    for which, es in sets.items():
      if es is not None:
        correct = self.fed.executor.correct_one(self.group, evaluation, p, client,
                                                self.fed.received(broadcast, round_index), es, which, self.index)
        out[which] = (correct, int(es.sizes[es.index(self.index)]))
    return out
