"""One client on its Flower node: its partition and architecture, its state between rounds, and its program's round
and score, run by the same jitted functions as the simulation's sequential executor.

A Flower SuperNode starts a new ClientApp process for every message, so the node rebuilds its view of the run
from the run's config each time (its partition of the seeded split, its architecture group) and keeps the
client's state (model, BatchNorm statistics, optimizer states, per-client modules) in its own folder: one file
per round after which it changed, `after_round_R.npz`. A round R reads the newest file at or before R, so a
server that resumes from the checkpoint of an earlier round finds the state that belongs to it; the server's
first message of a run removes the files after the round it starts from. The state never goes to the server.
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


def deployed_config(cfg: ExperimentConfig) -> ExperimentConfig:
  """The config a Flower run executes: one client per node, so the sequential executor's per-client functions on
  one device (the numbers do not depend on the executor)."""
  return dataclasses.replace(cfg, strategy='sequential', num_devices=1, chunk_size=0, memory_budget_gib=0.0,
                             stream_clients=False)


class NodeStates:
  """The folder of one client's states, one .npz of its leaves per round after which it changed."""

  def __init__(self, directory: str):
    self.directory = directory

  def rounds(self) -> list[int]:
    """The rounds with a saved state, ascending."""
    found = (_STATE_FILE.search(p) for p in glob.glob(os.path.join(self.directory, 'after_round_*.npz')))
    return sorted(int(m.group(1)) for m in found if m)

  def load(self, upto_round: int, template: Any) -> Optional[Any]:
    """The newest state saved after a round <= `upto_round`, in `template`'s structure; None when there is none."""
    saved = [r for r in self.rounds() if r <= upto_round]
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

  def save(self, after_round: int, state: Any) -> None:
    """Writes the state after round `after_round` atomically."""
    os.makedirs(self.directory, exist_ok=True)
    write_atomically(self._path(after_round), lambda f: np.savez(
        f, **{f'{i:05d}': np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}), binary=True)

  def forget_after(self, round_index: int) -> None:
    """Removes the states saved after rounds later than `round_index` (a run that starts over from there)."""
    for r in self.rounds():
      if r > round_index:
        os.remove(self._path(r))

  def _path(self, after_round: int) -> str:
    return os.path.join(self.directory, f'after_round_{after_round:06d}.npz')


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

  def state(self, round_index: int) -> Any:
    """The client's state as round `round_index` (0-based) starts."""
    saved = self.states.load(round_index, self.initial_state())
    return self.initial_state() if saved is None else saved

  def broadcast_template(self, round_index: int) -> Any:
    """The structure of what the client receives in round `round_index` (its group's broadcast as it reads it)."""
    p = self.fed.phase_index(round_index)
    phase, spec = self.fed.algorithm.phases[p], self.group.spec
    return jax.eval_shape(lambda s: for_client(phase.broadcast(s, spec), self.index), self.fed.server_shapes())

  def train(self, round_index: int, broadcast: Any) -> tuple[Any, float]:
    """The client's round `round_index` under `broadcast`: (its upload, its mean local loss); its new state is
    saved as the state after that round."""
    p = self.fed.phase_index(round_index)
    key, _ = self.fed.round_keys(round_index)
    program = self.fed.programs[p][self.group_index]
    client, upload, loss = self.fed.executor.run_one(self.group, program, p, self.index, self.state(round_index),
                                                     self.fed.received(broadcast, round_index), key)
    self.states.save(round_index + 1, client)
    return upload, float(loss)

  def evaluate(self, round_index: int, broadcast: Any) -> dict:
    """Correct predictions and test rows of the client after round `round_index` (0-based, the evaluation's
    phase), on its local test split ('local') and on the global test set ('global') where they exist."""
    p = self.fed.phase_index(round_index)
    client = self.state(round_index + 1)
    evaluation = self.fed.evaluations[self.group_index]
    out = {}
    sets = {'local': self.group.test if self.fed.has_local_test else None, 'global': self.fed.global_test}
    for which, es in sets.items():
      if es is not None:
        correct = self.fed.executor.correct_one(self.group, evaluation, p, client,
                                                self.fed.received(broadcast, round_index), es, which, self.index)
        out[which] = (correct, int(es.sizes[es.index(self.index)]))
    return out
