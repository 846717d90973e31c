"""A simulated federation: architecture groups of stacked clients running an `Algorithm`'s phases round by round.

A round samples participants (fixed-size slots per group, so partial participation never changes a shape), runs
each group's participants through the phase's client program with the executor, hands the per-group uploads to
the phase's server step, and measures what crossed. `evaluate` scores every client with the algorithm's
`Evaluation`. Sharding (vmap executor): with a `client_mesh` of D devices, each group's stacked states and data
are laid out along a 'clients' mesh axis; a group is padded to a multiple of D with copies of its last client
("phantom" slots), which train but are masked out of every upload, average and score, so results equal the
one-device run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import math
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_het.core import Algorithm, FederationSpec, Gathered, Phase, Uploads, for_client, server_step
from fedjax_het.data.federated import FederatedData
from fedjax_het.engine.accounting import accuracy_metrics, communication_metrics, count_uploads
from fedjax_het.engine.execution import ExecutionConfig
from fedjax_het.engine.executor import Executor
from fedjax_het.engine.groups import (EvalSet, Group, ModelConfig, build_groups, clients_without_steps, host_copy,
                                      init_group, slot_indices)
from fedjax_het.engine.plan import plan_stages
from fedjax_het.engine.schedule import Schedule
from fedjax_het.engine.sharding import place_replicated, to_device, to_host
from fedjax_het.engine.stores import RowStore
from fedjax_het.engine.streaming import host_states
from fedjax_het.errors import ConfigError
from fedjax_het.local_training import LocalTraining


def secret_key(secret: int, purpose: str) -> jax.Array:
  """A JAX key (threefry's uint32[2]) for `purpose` (e.g. 'clients, round 3') from a DP run's secret: the first 64
  bits of BLAKE2b keyed with the whole secret (up to 512 bits; a run's is 128, `run.experiment.dp_secret`) over the
  purpose. Each key is unpredictable without the whole secret, however many other keys of the run are known, and
  keys of different purposes or rounds are independent; `jax.random.PRNGKey(secret)` would keep its low 32 bits."""
  if not 0 <= secret < 2 ** 512:
    raise ConfigError(f'the DP secret must be a non-negative integer of at most 512 bits, not {secret!r}.')
  digest = hashlib.blake2b(purpose.encode(), key=secret.to_bytes(64, 'little'), digest_size=8,
                           person=b'fedjax_het key').digest()
  return to_device(np.frombuffer(digest, '<u4'), np.uint32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def seed_keys(seed: int, num: int, round_number: Optional[int] = None) -> tuple[jax.Array, ...]:
  """The `num` keys split(fold_in(PRNGKey(seed), round_number)), or split(PRNGKey(seed)) without a round number (a
  run's initial keys), in one program: eagerly, each of the six operations compiled one of its own."""
  root = jax.random.PRNGKey(seed)
  keys = jax.random.split(root if round_number is None else jax.random.fold_in(root, round_number), num)
  return tuple(keys[i] for i in range(num))


def _shared_feature_dim(groups: Sequence[Group], models: ModelConfig, algorithm: Algorithm) -> int:
  """The representation width d of the federation: the groups' one width under --rm=none, else ModelConfig's; a
  ConfigError where the widths differ and the method exchanges representations between architectures."""
  widths = sorted({g.spec.feature_dim for g in groups})
  if len(widths) > 1 and algorithm.capabilities.shares_representations:
    raise ConfigError(f'ModelConfig.rm={models.rm!r}: the architectures\' features have different widths {widths}, '
                      f'and {algorithm.name} exchanges representations (or heads) between them. Fix: '
                      f'ModelConfig.rm=\'ap\', \'mp\' or \'fc\' with one ModelConfig.feature_dim.')
  return widths[0] if models.rm == 'none' and len(widths) == 1 else models.feature_dim


def _checked_clients_without_steps(groups: Sequence[Group], training: LocalTraining, train_sizes: np.ndarray
                                   ) -> list:
  """The clients with fewer training rows than a batch (no local step under drop_last), logged; a ConfigError
  where that is every client."""
  without = clients_without_steps(groups, training.batch_size) if training.drop_last else []
  if len(without) == len(train_sizes):
    largest = int(train_sizes.max())
    raise ConfigError(f'LocalTraining.batch_size={training.batch_size} is larger than every client\'s training set '
                      f'(the largest holds {largest} rows), so no client could take a local step. Fix: '
                      f'LocalTraining.batch_size <= {largest}, fewer clients (make_federated_data.num_clients), or '
                      f'LocalTraining.drop_last=False (train on the partial batch, where the method supports it).')
  if without:
    logging.warning('LocalTraining.batch_size=%d: clients %s have fewer training samples than one batch and take '
                    'no local step (one epoch drops the last partial batch, as HtFLlib does).', training.batch_size,
                    without)
  return without


def client_index(groups: Sequence[Group], num_clients: int) -> tuple[list, np.ndarray]:
  """(client k's architecture, client k's group index) for every client, as the groups assigned them."""
  architectures, group_of = [None] * num_clients, np.zeros(num_clients, int)
  for gi, g in enumerate(groups):
    for k in g.clients:
      architectures[k], group_of[k] = g.arch, gi
  return architectures, group_of


def wants_progress_bar() -> bool:
  """Whether a `Federation` shows its bar by default: where stderr is a terminal, or in a Jupyter kernel (whose
  stderr is no terminal, and whose reader sits waiting at the cell)."""
  try:
    if sys.stderr.isatty():
      return True
  except (AttributeError, ValueError):
    pass
  ipython = sys.modules.get('IPython')
  shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, 'get_ipython') else None
  return type(shell).__name__ == 'ZMQInteractiveShell'


def progress_bar_class():
  """tqdm's bar: its notebook widget where ipywidgets is installed (tqdm.auto's choice in a notebook), its text
  bar elsewhere (without ipywidgets tqdm.auto warns in a notebook, and the text bar works there)."""
  import importlib.util
  if importlib.util.find_spec('ipywidgets') is not None:
    from tqdm.auto import tqdm
  else:
    from tqdm.std import tqdm
  return tqdm


class FederationState(NamedTuple):
  """Everything a round changes: per-group stacked client states, the server state and the round counter."""
  groups: tuple
  server: Any
  round: jnp.ndarray


class GroupRound(NamedTuple):
  """One group's share of a round, as its participants ran it: slot_idx (local client indices, `Group.stacked_size`
  marking an empty slot), the updated stacked client states (None where they live elsewhere, e.g. on Flower
  nodes), the uploads stacked over slots (zeros in empty slots) and each slot's mean local loss."""
  slot_idx: np.ndarray
  stacked: Any
  uploads: Any
  losses: Any


def _check_arguments(algorithm: Algorithm, training: LocalTraining, join_ratio: float,
                     full_participation_rounds: int) -> None:
  """The `Federation` arguments checked before anything is built, each refused with its fix."""
  if not 0 < join_ratio <= 1:
    raise ConfigError(f'Federation.join_ratio={join_ratio} must be in (0, 1].')
  if full_participation_rounds < 0:
    raise ConfigError(f'Federation.full_participation_rounds={full_participation_rounds} must be >= 0.')
  if not training.drop_last and not algorithm.capabilities.partial_batches:
    raise ConfigError(f'LocalTraining.drop_last=False: {algorithm.name} does not weight its losses by the real rows of '
                      f'a partial batch yet, so it only runs with epochs of full batches. Fix: '
                      f'LocalTraining.drop_last=True.')


class Federation:
  """Builds groups from a `FederatedData` and a model family, and runs rounds of an `Algorithm`.

  `init()` returns the initial `FederationState`; `round(state)` runs one round of the phase it falls in and
  returns (state, metrics); `evaluate(state)` scores every client on its test data.

  models: the clients' classifiers (`ModelConfig`, or just the architecture names); training: the run's local
  schedule, handed to the algorithm's programs through `GroupSpec.training`; execution: how rounds run
  (`ExecutionConfig`, which changes no number beyond float32 rounding); rounds: the run's length (phases of open
  length take the rounds left); join_ratio: the share of clients in each round; full_participation_rounds: the
  run's last rounds in which every client joins; participation: 'fixed' (that share of the clients, drawn without
  replacement) or 'poisson' (each client with that probability; `engine.schedule`); seed: the run's seed. secret:
  under differential privacy, a
  secret integer (128 bits of the operating system's entropy) from which the round keys are derived in place of the
  seed (the clients' and the server's randomness, their DP noise included; `secret_key`), so that nobody who knows
  the seed can regenerate the noise; with secret_draw, the participant draw too (what amplification by sampling
  assumes). progress_bar: a bar on stderr while a call compiles (`init`, the first round of each phase, the first
  `evaluate`), over the groups and the server step, since such a call can take a minute; None (the default) shows
  it where stderr is a terminal or the code runs in a Jupyter notebook, True always, False never.
  """

  def __init__(self, algorithm: Algorithm, data: FederatedData, models: ModelConfig | Sequence[str],
               training: LocalTraining, execution: ExecutionConfig = ExecutionConfig(), *, rounds: int = 0,
               join_ratio: float = 1.0, full_participation_rounds: int = 0, seed: int = 0,
               secret: Optional[int] = None, secret_draw: bool = False, participation: str = 'fixed',
               progress_bar: Optional[bool] = None):
    if not isinstance(models, ModelConfig):
      models = ModelConfig(tuple(models))
    _check_arguments(algorithm, training, join_ratio, full_participation_rounds)
    execution = execution.resolve(largest_group=max(collections.Counter(models.architectures(
        data.num_clients)).values(), default=0))
    self.algorithm, self.data, self.training, self.models, self.execution = (algorithm, data, training, models,
                                                                              execution)
    self.seed, self.join_ratio, self.full_participation_rounds = seed, join_ratio, full_participation_rounds
    self.secret = secret
    self.strategy, self.conv, self.mesh = execution.strategy, execution.conv, execution.client_mesh
    self.num_devices, self.num_clients = execution.num_devices, data.num_clients
    self.executor: Executor = execution.executor()
    global_test = data.global_test_rows()
    self.global_test = None if global_test is None else EvalSet(RowStore(global_test), shared=True)
    self.groups: list[Group] = build_groups(data, models, training, self.conv, self.num_devices, self.mesh, seed,
                                            execution.single_client_conv, execution.scan_blocks)
    self.architectures, self.group_of = client_index(self.groups, self.num_clients)
    feature_dim = _shared_feature_dim(self.groups, models, algorithm)
    if self.global_test is None and not any(g.test.sizes.sum() > 0 for g in self.groups):
      raise ConfigError('make_federated_data.train_fraction: no client has local test rows and there is no global '
                        'test set, so nothing can be evaluated. Fix: make_federated_data.train_fraction < 1 or '
                        'make_federated_data.eval_protocol=\'global\'.')
    self.train_sizes = np.zeros(self.num_clients, int)  # per global client id, host copy
    for g in self.groups:
      self.train_sizes[g.clients] = g.train_sizes
    self.spec = FederationSpec(data.num_classes, feature_dim, self.num_clients, rounds,
                               tuple(g.spec for g in self.groups), training)
    self.schedule = Schedule(algorithm.name, algorithm.phases, self.num_clients, rounds, join_ratio,
                             full_participation_rounds, secret if secret_draw and secret is not None else seed,
                             participation=participation)
    self.phase_starts = self.schedule.phase_starts
    self.total_rounds = self.schedule.total_rounds
    self.programs = [[phase.client(g.spec) for g in self.groups] for phase in algorithm.phases]
    self.evaluations = [algorithm.evaluation(g.spec) for g in self.groups]
    self.clients_without_steps = _checked_clients_without_steps(self.groups, training, self.train_sizes)
    self._jitted: dict = {}
    self._compiled_parts: set = set()  # ('round', phase) and ('eval', phase, which) run once: their programs exist
    self._server_shapes = None
    # Called as progress(what, group index, groups) after each group's part of `init` ('init') and of a round
    # ('round'): where each group's programs compile on first use, a start-up display can follow them.
    self.progress: Optional[Callable[[str, int, int], None]] = None
    self.progress_bar = wants_progress_bar() if progress_bar is None else bool(progress_bar)
    self._bar = None  # the bar of the call that compiles now (`_compiling`)
    self.constants = None if algorithm.constants is None else place_replicated(algorithm.constants, self.mesh)

  def phase_index(self, round_index: int) -> int:
    """The phase that round `round_index` (0-based) belongs to."""
    return self.schedule.phase_index(round_index)

  def phase_ends(self, round_index: int) -> bool:
    """Whether round `round_index` (0-based) is the last of its phase (or of the run)."""
    return round_index + 1 in self.phase_starts[1:] or round_index + 1 == self.total_rounds

  def evaluates_after(self, round_index: int, every: int) -> bool:
    """Whether the run evaluates after round `round_index`: every `every` rounds within phases whose `evaluate`
    is set, after the last round of each such phase (e.g. FedVTC's accuracy before fine-tuning), and after the
    run's last round."""
    if round_index + 1 == self.total_rounds:
      return True
    return self.phase(round_index).evaluate and ((round_index + 1) % every == 0 or self.phase_ends(round_index))

  def phase(self, round_index: int) -> Phase:
    """The `Phase` of round `round_index` (0-based)."""
    return self.algorithm.phases[self.phase_index(round_index)]

  # ---------------------------------------------------------------- initialisation
  def _init_keys(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    init_key, key_key, server_key = seed_keys(self.seed, 3)
    return init_key, key_key, server_key

  def init(self) -> FederationState:
    """Initial client states (`groups.init_group`) and the server state."""
    server_key = self._init_keys()[2]
    with self._compiling('the initial states', server_step=False):
      states = self.each_group(self.init_group, 'init', compiles=True)
    states = tuple(host_states(s) for s in states) if self.execution.stream_clients else tuple(states)
    initial = tuple(host_copy(s) for s in states)
    server = place_replicated(self.algorithm.init_server(server_key, self.spec, initial), self.mesh)
    return FederationState(states, server, jnp.asarray(0, jnp.int32))

  def init_group(self, gi: int) -> Any:
    """Group gi's stacked initial client states, as `init` makes them."""
    init_key, key_key, _ = self._init_keys()
    return init_group(self.algorithm, self.groups[gi], init_key, key_key, self.models.shared_init, self.mesh)

  def server_shapes(self) -> Any:
    """The structure, shapes and dtypes of the server state (`jax.ShapeDtypeStruct`s), without computing it."""
    if self._server_shapes is not None:
      return self._server_shapes
    server_key = self._init_keys()[2]
    one = lambda stacked: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked)
    initial = tuple(one(jax.eval_shape(lambda gi=gi: self.init_group(gi))) for gi in range(len(self.groups)))
    self._server_shapes = jax.eval_shape(lambda init: self.algorithm.init_server(server_key, self.spec, init),
                                         initial)
    return self._server_shapes

  # ---------------------------------------------------------------- sampling
  def num_join(self, round_index: int = 0) -> int:
    """Participants per round in the phase of `round_index` (`Schedule.num_join`)."""
    return self.schedule.num_join(round_index)

  def participants(self, round_index: int) -> np.ndarray:
    """Ascending ids of the clients that train in `round_index` (`Schedule.participants`)."""
    return self.schedule.participants(round_index)

  def slots(self, round_index: int) -> list[int]:
    """Participant slots per group in round `round_index`, a multiple of the device count: under a fixed-size draw
    min(group size, participants), fixed within a phase (no recompiles); under Poisson sampling, where the count
    varies, the group's expected count plus four standard deviations, or the whole group in the rare round that
    draws more (two shapes per rate, so at most two compilations)."""
    if not self.schedule.poisson:
      counts = [min(g.size, self.num_join(round_index)) for g in self.groups]
    else:
      rate, drawn = self.schedule.rate(round_index), self.participants(round_index)
      counts = []
      for g in self.groups:
        bound = min(g.size, math.ceil(rate * g.size + 4 * math.sqrt(rate * (1 - rate) * g.size)) + 1)
        counts.append(bound if np.isin(g.clients, drawn).sum() <= bound else g.size)
    return [-(-n // self.num_devices) * self.num_devices for n in counts]

  def local_work(self, participants: np.ndarray, phase: int) -> dict:
    """Local steps and samples the participants process in a round of `phase`, as its programs' plans
    (`engine.plan`) lay them out: per stage epochs * (n_k // B) steps of B rows under drop_last; without it
    ceil(n_k / B) steps, the last of the n_k mod B remaining rows; max(1, n_k // B) steps of min(n_k, B) rows per
    epoch in a generated stage; at most --local_steps per stage; summed over participants and stages."""
    steps = samples = 0
    for g, program in zip(self.groups, self.programs[phase]):
      for n in g.train_sizes[np.isin(g.clients, participants)].tolist():
        for plan in plan_stages(program, n):
          steps, samples = steps + int(plan.valid(n).sum()), samples + int(plan.rows(n).sum())
    return {'local_steps': steps, 'local_samples': samples}

  # ---------------------------------------------------------------- one round
  def _fn(self, name: str, where, make):
    if (name, where) not in self._jitted:
      self._jitted[(name, where)] = make()
    return self._jitted[(name, where)]

  def sent(self, server: Any, gi: int, round_index: int) -> Any:
    """What the server sends group gi's participants in round `round_index` (the phase's broadcast)."""
    p = self.phase_index(round_index)
    return self._fn('broadcast', (p, gi), lambda: jax.jit(
        lambda s: self.algorithm.phases[p].broadcast(s, self.groups[gi].spec)))(server)

  def broadcast(self, server: Any, gi: int, round_index: int) -> Any:
    """What group gi's programs and evaluation read in round `round_index`: what the server sends, with the
    algorithm's constants where the phase reads them (`received`)."""
    return self.received(self.sent(server, gi, round_index), round_index)

  def received(self, broadcast: Any, round_index: int) -> Any:
    """A sent `broadcast` as the programs of round `round_index` read it: with the constants the clients hold
    (`Phase.with_constants`); as sent where the phase reads none."""
    phase = self.algorithm.phases[self.phase_index(round_index)]
    if phase.with_constants is None or self.constants is None:
      return broadcast
    return phase.with_constants(broadcast, self.constants)

  def round_keys(self, round_index: int) -> tuple[jax.Array, jax.Array]:
    """(clients' key, server's key) of round `round_index`; client k trains with fold_in(clients' key, k). From the
    seed without a `secret`; with one, each key is `secret_key(secret, purpose)`, a keyed hash of the whole secret,
    so that no key can be found without all of its bits."""
    if self.secret is not None:
      return (secret_key(self.secret, f'clients, round {round_index + 1}'),
              secret_key(self.secret, f'server, round {round_index + 1}'))
    key, server_key = seed_keys(self.seed, 2, round_index + 1)
    return key, server_key

  def round(self, state: FederationState) -> tuple[FederationState, dict]:
    """One communication round (for FedRE: Alg. 1, lines 5-13, of "FedRE: A Representation Entanglement Framework
    for Model-Heterogeneous Federated Learning"); returns the new state and metrics. The round consumes `state`:
    its client states' memory is reused for the new ones (XLA buffer donation), so keep the returned state, or
    copy the old one first (`jax.device_put(state, may_alias=False)`, which compiles nothing) to keep both.

    Metrics: round, phase, train_loss (mean over participants of their mean local-step loss), participants,
    local_steps and local_samples, the server's metrics, upload/broadcast scalars and bytes (total and by part)
    and train_seconds; under Poisson sampling the round's sampling_rate (and no train_loss in a round that drew
    nobody: `empty_round`).
    """
    self.execution.apply_process_settings()
    start = time.perf_counter()
    r = int(state.round)
    p = self.phase_index(r)
    key, _ = self.round_keys(r)
    participants = self.participants(r)
    if not len(participants) and not self.phase(r).runs_without_participants:
      return self.empty_round(state, start)
    slots = self.slots(r)

    def run(gi):
      g = self.groups[gi]
      slot_idx = slot_indices(g, participants, slots[gi])
      broadcast = self.broadcast(state.server, gi, r)
      return GroupRound(slot_idx, *self.executor.run(g, self.programs[p][gi], p, state.groups[gi], slot_idx,
                                                      broadcast, key))
    compiles = ('round', p) not in self._compiled_parts
    with self._compiling(f'round {r + 1} ({self.phase(r).name})', active=compiles):
      results = self.each_group(run, 'round', compiles=compiles)
      self._compiled_parts.add(('round', p))
      if self._bar is not None:
        self._bar.set_postfix_str('the server step', refresh=True)
      out = self.finish_round(state, results, participants, start)
      if self._bar is not None:
        self._bar.update(1)
    return out

  def _compiling(self, what: str, active: bool = True, server_step: bool = True):
    """A context in which a call compiles `what`: with `progress_bar`, a bar on stderr over the groups (`_report`)
    and, with `server_step`, the server's step; nothing otherwise."""
    import contextlib
    if not (active and self.progress_bar) or self._bar is not None:
      return contextlib.nullcontext()
    bar = progress_bar_class()(total=len(self.groups) + server_step, desc=f'{self.algorithm.name}: compiling {what}',
                               unit='step', leave=False, file=sys.stderr)
    bar.set_postfix_str(f'{len(self.groups)} architecture group(s)', refresh=True)
    self._bar = bar

    @contextlib.contextmanager
    def shown():
      try:
        yield bar
      finally:
        bar.close()
        self._bar = None
    return shown()

  def empty_round(self, state: FederationState, start: float) -> tuple[FederationState, dict]:
    """A round whose Poisson draw took nobody: nothing trains or crosses, the server stays as it was, and the row
    says so (no training loss: there was none)."""
    r = int(state.round)
    metrics = {'round': r + 1, 'phase': self.phase(r).name, 'participants': 0, 'local_steps': 0, 'local_samples': 0,
               'sampling_rate': self.schedule.rate(r), **communication_metrics([], [])}
    metrics['train_seconds'] = time.perf_counter() - start
    return state._replace(round=state.round + 1), metrics

  def each_group(self, fn: Callable[[int], Any], what: str, compiles: bool) -> list:
    """[fn(gi) for every group index], reported to `progress` as `what` group by group. Where `compiles` (the
    groups' programs compile in these calls), `ExecutionConfig.group_threads` groups run at once, one host thread
    each, so that their compilations overlap; the groups are independent, so the results do not depend on it."""
    threads = min(self.execution.group_threads, len(self.groups)) if compiles else 1
    if threads <= 1:
      out = []
      for gi in range(len(self.groups)):
        out.append(fn(gi))
        self._report(what, gi)
      return out
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix='group') as pool:
      futures = {pool.submit(fn, gi): gi for gi in range(len(self.groups))}
      try:
        for future in concurrent.futures.as_completed(futures):
          future.result()  # the first failure raises here
          self._report(what, futures[future])
        return [future.result() for future in futures]
      except BaseException:
        for future in futures:
          future.cancel()
        raise

  def _report(self, what: str, gi: int) -> None:
    if self._bar is not None:
      self._bar.set_postfix_str(f'group {self.groups[gi].arch}', refresh=False)
      self._bar.update(1)
    if self.progress is not None:
      self.progress(what, gi, len(self.groups))

  def finish_round(self, state: FederationState, results: Sequence['GroupRound'], participants: np.ndarray,
                   start: float) -> tuple[FederationState, dict]:
    """The server's half of round `state.round` from each group's `GroupRound`: the uploads (a slot past the group
    is empty), the phase's server step, what crossed, and the round's metrics (see `round`)."""
    r = int(state.round)
    p = self.phase_index(r)
    phase = self.algorithm.phases[p]
    _, server_key = self.round_keys(r)
    expected = self.schedule.expected_count(r) if self.schedule.poisson else None
    groups, uploads, losses, upload_parts, broadcast_parts = [], [], [], [], []
    for gi, (g, result) in enumerate(zip(self.groups, results)):
      slot_idx, values = result.slot_idx, result.uploads
      broadcast = self.sent(state.server, gi, r)
      real = to_device(slot_idx < g.size)
      num_train = to_device(np.where(slot_idx < g.size, self.train_sizes[g.clients[np.minimum(
          slot_idx, g.size - 1)]], 0), np.float32)
      groups.append(result.stacked)
      uploads.append(Uploads(values, real, num_train, to_device(slot_idx, np.int32),
                             None if expected is None else to_device(np.full(len(slot_idx), expected, np.float32))))
      losses.append((result.losses, slot_idx < g.size))
      upload_parts.append(self._fn('count_uploads', (p, gi), lambda: jax.jit(
          lambda u, m: count_uploads(phase.traffic.upload, u, m)))(values, real))
      received = phase.traffic.received
      if received is not None:  # what each participant receives depends on it
        broadcast_parts.append((self._fn('count_received', (p, gi), lambda: jax.jit(
            lambda b, u, m: count_uploads(lambda one: received(b, one), u, m)))(broadcast, values, real), 1))
      else:
        receivers = int(np.sum(slot_idx < g.size))
        broadcast_parts.append((self._fn('count_broadcast', (p, gi), lambda: jax.jit(
            lambda b: {k: jnp.asarray(v, jnp.float32) for k, v in phase.traffic.broadcast(
                for_client(b, 0)).items()}))(broadcast), receivers))
    server_update = self._fn('server', p, lambda: jax.jit(self._server_step(phase)))
    server, server_metrics = server_update(state.server, tuple(uploads), server_key, self.constants)
    new_state = FederationState(tuple(groups), server, state.round + 1)
    losses = np.concatenate([to_host(loss)[real] for loss, real in losses])  # host reads after all dispatches
    metrics = {'round': r + 1, 'phase': phase.name, 'train_loss': float(np.mean(losses)) if len(losses) else
               float('nan'), 'participants': len(participants),
               **self.local_work(participants, p)}
    if self.schedule.poisson:
      metrics['sampling_rate'] = self.schedule.rate(r)
      if not len(losses):  # nobody drawn, the step ran anyway (`Phase.runs_without_participants`)
        del metrics['train_loss']
    metrics.update(communication_metrics([jax.device_get(u) for u in upload_parts],
                                         [(jax.device_get(b), n) for b, n in broadcast_parts]))
    metrics.update({k: float(v) for k, v in server_metrics.items()})
    jax.block_until_ready(new_state)
    metrics['train_seconds'] = time.perf_counter() - start
    return new_state, metrics

  def _server_step(self, phase: Phase):
    """The phase's server step (server, uploads, key, constants) -> (server, metrics); the constants reach a step
    of an algorithm that has some (`Algorithm.constants`)."""
    step = server_step(phase, self.spec)
    if self.constants is None:
      return lambda server, uploads, key, constants: step(server, uploads, key)
    return step

  # ---------------------------------------------------------------- evaluation
  def evaluate(self, state: FederationState) -> dict:
    """Accuracy of every client under the algorithm's `Evaluation` (the broadcast of the phase of the last round).

    Per prediction: sample-weighted sum(correct)/sum(n) over all clients (HtFLlib's metric), the per-client mean
    and std, and (the first, reported, one) the per-client accuracies. The unprefixed metrics follow the
    evaluation protocol: local test splits ('pooled') or the global test set ('global'); when both exist (global
    protocol with train_fraction < 1) the other is logged with prefix 'local_test_' or 'global_test_'.
    """
    self.execution.apply_process_settings()
    r = max(int(state.round) - 1, 0)
    statistics = self.evaluation_statistics(state, r)
    local = self._evaluate_set(state, r, 'local', statistics) if self.has_local_test else None
    glob = self._evaluate_set(state, r, 'global', statistics) if self.global_test is not None else None
    return self.accuracy(local, glob)

  def evaluation_statistics(self, state: FederationState, round_index: int) -> Any:
    """The evaluations' statistics (`Evaluation.statistics`) summed over every client's training rows, or None
    where no group's evaluation has any."""
    if all(e.statistics is None for e in self.evaluations):
      return None
    p = self.phase_index(round_index)
    key, _ = self.round_keys(round_index)  # each client's pass shuffles and augments from it (`statistics_key`)
    parts = [self.executor.statistics(g, self.evaluations[gi], p, state.groups[gi],
                                      self.broadcast(state.server, gi, round_index), key)
             for gi, g in enumerate(self.groups) if self.evaluations[gi].statistics is not None]
    return jax.tree.map(lambda *a: sum(a), *parts)

  @property
  def has_local_test(self) -> bool:
    """Whether any client has local test rows."""
    return any(g.test.sizes.sum() > 0 for g in self.groups)

  def accuracy(self, local: Optional[tuple], glob: Optional[tuple]) -> dict:
    """The metrics of `evaluate` from (correct [clients, predictions], test rows [clients]) on the local test
    splits and on the global test set (None where there is none)."""
    primary, secondary, prefix = ((glob, local, 'local_test_') if self.data.protocol == 'global'
                                  else (local, glob, 'global_test_'))
    names = self.evaluations[0].names
    out = accuracy_metrics(names, *primary, prefix='', per_client=True)
    if secondary is not None:
      out.update(accuracy_metrics(names, *secondary, prefix=prefix, per_client=False))
    return out

  def _evaluate_set(self, state: FederationState, round_index: int, which: str, statistics: Any = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    names = self.evaluations[0].names
    correct, counts = np.zeros((self.num_clients, len(names))), np.zeros(self.num_clients)
    p = self.phase_index(round_index)
    for gi, g in enumerate(self.groups):
      if self.evaluations[gi].names != names:
        raise ConfigError(f'{self.algorithm.name}: every group must score the same predictions; group {g.arch!r} '
                          f'scores {self.evaluations[gi].names}, the first {names}.')

    def score(gi):
      g = self.groups[gi]
      es = g.test if which == 'local' else self.global_test
      broadcast = self.broadcast(state.server, gi, round_index)
      if statistics is not None:
        broadcast = Gathered(broadcast, statistics)
      return self.executor.correct(g, self.evaluations[gi], p, state.groups[gi], broadcast, es, which)
    part = ('eval', p, which)
    with self._compiling(f'the evaluation ({which} test rows)', active=part not in self._compiled_parts,
                         server_step=False):
      scores = self.each_group(score, 'evaluate', compiles=part not in self._compiled_parts)
    self._compiled_parts.add(part)
    for g, group_correct in zip(self.groups, scores):
      es = g.test if which == 'local' else self.global_test
      correct[g.clients] = group_correct
      counts[g.clients] = [es.sizes[es.index(i)] for i in range(g.size)]
    return correct, counts
