"""A simulated federation: architecture groups of stacked clients, one compiled update per group and round.

Clients with the same architecture form a group whose states are one pytree with a leading client axis. A round
samples participants (fixed-size slots per group, so partial participation never changes a shape), updates each
group with its execution strategy, concatenates the uploads of all groups along the slot axis, and runs the
algorithm's server step once.

Execution strategies (same pure pieces, same numbers):
  vmap:       `jax.vmap(client_update)` over the group's slots in one jitted call; local steps in a lax.scan
              (optionally in chunks of `chunk_size` clients). The fast path on accelerators.
  sequential: the host walks the participants; each runs the same begin / SGD step / representation / upload
              functions, each jitted once and reused. Only a client's real steps run. `client_threads` clients
              run at once, one host thread each. The fast path on XLA:CPU, which runs convolutions inside
              while-loops and vmapped (grouped) convolutions several times slower.

Sharding (vmap strategy): with a `client_mesh` of D devices, each group's stacked states and data are laid out
along a 'clients' mesh axis, so each device updates its share of the clients in the same jitted call (SPMD). A
group is padded to a multiple of D with copies of its last client ("phantom" slots), which train but are masked
out of every upload, average and score, so results equal the one-device run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from fedjax_het.algorithms.base import Algorithm, CommSpec
from fedjax_het.data.federated import ClientArrays, FederatedData
from fedjax_het.engine.client_update import client_update
from fedjax_het.engine.forward import forward, head_logits, represent_rows
from fedjax_het.engine.state import ClientState
from fedjax_het.engine.sharding import CLIENTS_AXIS, place_clients, to_host
from fedjax_het.engine.training import LocalTraining, batch_schedule, initial_carry, sgd_step, step_key
from fedjax_het.errors import ConfigError
from fedjax_het.models.classifier import Companion, HeteroClassifier
from fedjax_het.models.init import INITS, architecture_key, torch_default_init
from fedjax_het.models.registry import assign_models, build_model

STRATEGIES = ('vmap', 'sequential')


def default_strategy(backend: Optional[str] = None) -> str:
  """'sequential' on CPU (measured faster there, see README), 'vmap' on GPU/TPU."""
  return 'sequential' if (backend or jax.default_backend()) == 'cpu' else 'vmap'


def default_conv(strategy: str, backend: Optional[str] = None) -> str:
  """On CPU: 'im2col' under vmap (grouped convolutions are slow there), 'auto' otherwise; 'xla' on GPU/TPU.
  Figures in the README."""
  if (backend or jax.default_backend()) != 'cpu':
    return 'xla'
  return 'im2col' if strategy == 'vmap' else 'auto'


def default_eval_batch_size(backend: Optional[str] = None) -> int:
  """Rows per eval-mode forward pass (representations, evaluation): 64 on CPU, where larger passes spill the
  im2col patches out of cache and run ~2x slower per row (benchmarks/cpu_kernels.py --parts=represent), 256 on
  GPU/TPU."""
  return 64 if (backend or jax.default_backend()) == 'cpu' else 256


def default_client_threads() -> int:
  """Host threads of the sequential strategy: 2 (measured on 2 cores, README), at most the core count."""
  return max(1, min(2, os.cpu_count() or 1))


class FederationState(NamedTuple):
  """Everything a round changes: per-group stacked client states, the server state and the round counter."""
  groups: tuple
  server: Any
  round: jnp.ndarray


@dataclasses.dataclass
class EvalSet:
  """Test rows: per client ([G, n_max, ...], client i scored on row block i) or one set shared by every client."""
  arrays: ClientArrays
  shared: bool

  def __post_init__(self):
    self.sizes = np.asarray(self.arrays.n)  # host copy: loops are planned without device reads

  def index(self, i: int) -> int:
    """Which row block client i is scored on."""
    return 0 if self.shared else i


@dataclasses.dataclass
class Group:
  """Clients sharing one architecture, with their padded data on device.

  The stacked arrays have `stacked_size` >= size rows on the client axis: rows past `size` are phantom copies of
  the last client that only pad the axis to a multiple of the device count.
  """
  arch: str
  model: HeteroClassifier
  clients: np.ndarray          # global client ids, ascending
  train: ClientArrays          # stacked [stacked_size, n_max, ...]
  test: EvalSet                # the clients' local test splits
  num_params: int = 0
  num_companion_params: int = 0

  def __post_init__(self):
    self.train_sizes = to_host(self.train.n)[:len(self.clients)]
    self.stacked_size = int(self.train.n.shape[0])
    self.stacked_ids = jnp.asarray(_pad_clients(self.clients, self.stacked_size))

  @property
  def size(self) -> int:
    return len(self.clients)


def _take(tree: Any, idx) -> Any:
  return jax.tree.map(lambda a: jnp.take(a, idx, axis=0, mode='clip'), tree)


def _pad_clients(tree: Any, size: int) -> Any:
  """Pads the leading (client) axis of host arrays to `size` with copies of the last client."""
  return jax.tree.map(lambda a: np.concatenate([a, np.repeat(a[-1:], size - a.shape[0], 0)]), tree)


def _pad_to(a: jnp.ndarray, shape: tuple[int, ...]) -> jnp.ndarray:
  return jnp.pad(a, [(0, t - s) for s, t in zip(a.shape, shape)])


def _check_architecture(model: HeteroClassifier, arch: str, image_shape: tuple[int, ...],
                        companion: Optional[Companion] = None) -> tuple[int, int]:
  """Traces one forward pass abstractly and returns the parameter counts (own model, companion), so an
  architecture that cannot take the data's images fails here, with the flag named, instead of deep inside XLA."""
  sample = jnp.zeros((1,) + tuple(image_shape))
  if model.companion is not None:
    _trace(model.companion, sample, f'the shared model {companion.arch!r} trained beside every client',
           '--global_model')
  _, variables = _trace(model, sample, f'--models: architecture {arch!r}', '--models')
  params = dict(variables['params'])
  count = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
  companion = count(params.pop('companion', {}))
  return count(params), companion


def _trace(model, sample: jnp.ndarray, what: str, flag: str):
  try:
    return jax.eval_shape(lambda: model.init_with_output(jax.random.PRNGKey(0), sample))
  except ConfigError:
    raise
  except Exception as e:  # Flax/XLA raise many types for impossible shapes (ZeroDivisionError, TypeError, ...).
    raise ConfigError(f'{what} cannot take images of shape {tuple(sample.shape[1:])} '
                      f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}). Fix: choose, with '
                      f'{flag}, models for this image size (e.g. small_cnn or mlp for 8x8 digits; cnn4 and resnet* '
                      f'for 32x32).') from e


def _even_chunk(rows: int, max_chunk: int) -> int:
  """The smallest chunk that covers `rows` in as few passes of at most `max_chunk` rows (288 rows with at most
  256 per pass: 2 x 144, not 256 + a clamped 256 that recomputes 224 rows)."""
  passes = -(-max(rows, 1) // max(max_chunk, 1))
  return -(-max(rows, 1) // passes)


def _represent_into(model: HeteroClassifier, chunk: int):
  """Jitted (buf, client, x_all, i, start) -> buf with eval-mode (logits, reps) of rows [start, start+chunk) of
  client i written in. Near the end dynamic_slice and dynamic_update_slice clamp the start identically, so the
  last chunk recomputes a few rows instead of reading past n_max."""
  def represent_into(buf, client, x_all, i, start):
    rows = jax.lax.dynamic_slice_in_dim(x_all[i], start, chunk)
    logits, reps, _ = forward(model, client.params, client.model_state, rows, False)
    return (jax.lax.dynamic_update_slice_in_dim(buf[0], logits, start, 0),
            jax.lax.dynamic_update_slice_in_dim(buf[1], reps, start, 0))
  return jax.jit(represent_into, donate_argnums=0)


def concat_uploads(uploads: Sequence[Any]) -> Any:
  """Concatenates per-group uploads along the slot axis, zero-padding ragged row axes (e.g. FedAllRep rows)."""
  def cat(*leaves):
    shape = tuple(max(s) for s in zip(*(leaf.shape for leaf in leaves)))
    return jnp.concatenate([_pad_to(leaf, (leaf.shape[0],) + shape[1:]) for leaf in leaves])
  return jax.tree.map(cat, *uploads)


class Federation:
  """Builds groups from a `FederatedData` and a model family, and runs rounds of an `Algorithm`.

  `init()` returns the initial `FederationState`; `round(state)` runs one round and returns (state, metrics);
  `evaluate(state)` scores every client on its test data with each of the algorithm's eval heads.
  """

  def __init__(self, algorithm: Algorithm, data: FederatedData, models: Sequence[str], training: LocalTraining,
               feature_dim: int = 512, rm: str = 'ap', strategy: Optional[str] = None, join_ratio: float = 1.0,
               seed: int = 0, chunk_size: int = 0, eval_batch_size: Optional[int] = None, conv: Optional[str] = None,
               scan_unroll: int = 1, client_mesh: Optional[jax.sharding.Mesh] = None,
               client_threads: Optional[int] = None, init: str = 'torch', shared_init: bool = True):
    strategy = strategy or default_strategy()
    if init not in INITS:
      raise ConfigError(f'--init={init!r} is unknown; choose one of {", ".join(INITS)} (torch: PyTorch\'s default '
                        f'Conv/Linear initialisation, as HtFLlib; flax: Flax\'s defaults).')
    if strategy not in STRATEGIES:
      raise ConfigError(f'--strategy={strategy!r} is unknown; choose one of {", ".join(STRATEGIES)}.')
    if client_mesh is not None and client_mesh.axis_names != (CLIENTS_AXIS,):
      raise ConfigError(f'client_mesh must have the single axis {CLIENTS_AXIS!r}; got {client_mesh.axis_names}. '
                        f'Fix: build it with fedjax_het.engine.client_mesh().')
    if client_mesh is not None and client_mesh.size > 1 and strategy != 'vmap':
      raise ConfigError(f'--num_devices={client_mesh.size}: sharding clients over devices needs --strategy=vmap '
                        f'(got {strategy!r}). Fix: --strategy=vmap, or --num_devices=1.')
    if chunk_size and client_mesh is not None and client_mesh.size > 1 and chunk_size % client_mesh.size:
      raise ConfigError(f'--chunk_size={chunk_size} must be a multiple of the {client_mesh.size} devices of the '
                        f'client mesh, so every chunk splits evenly. Fix: --chunk_size='
                        f'{client_mesh.size * max(1, chunk_size // client_mesh.size)}.')
    client_threads = default_client_threads() if client_threads is None else client_threads
    if client_threads < 1:
      raise ConfigError(f'--client_threads={client_threads} must be >= 1.')
    if scan_unroll < 1:
      raise ConfigError(f'--scan_unroll={scan_unroll} must be >= 1 (local steps per loop iteration).')
    if not 0 < join_ratio <= 1:
      raise ConfigError(f'--join_ratio={join_ratio} must be in (0, 1].')
    if feature_dim < 1:
      raise ConfigError(f'--feature_dim={feature_dim} must be >= 1.')
    self.algorithm, self.data, self.training = algorithm, data, training
    self.strategy, self.seed, self.chunk_size, self.scan_unroll = strategy, seed, chunk_size, scan_unroll
    self.client_threads, self._threads = client_threads, None
    self.init_scheme, self.shared_init = init, shared_init
    self.conv = conv or default_conv(strategy)
    self.mesh = client_mesh if client_mesh is not None and client_mesh.size > 1 else None
    num_devices = 1 if self.mesh is None else self.mesh.size
    self.eval_batch_size = eval_batch_size or default_eval_batch_size()
    if self.eval_batch_size < 1:
      raise ConfigError(f'--eval_batch_size={eval_batch_size} must be >= 1 (0: the backend default).')
    self.num_clients = data.num_clients
    self.num_join = max(1, int(self.num_clients * join_ratio + 1e-9))
    self.architectures = assign_models(list(models), self.num_clients)
    global_test = data.global_test()
    self.global_test = None if global_test is None else EvalSet(jax.device_put(global_test), shared=True)
    self.groups: list[Group] = []
    for arch in dict.fromkeys(self.architectures):
      ids = np.array([k for k, a in enumerate(self.architectures) if a == arch])
      stacked = -(-len(ids) // num_devices) * num_devices
      place = lambda arrays: place_clients(_pad_clients(arrays, stacked), self.mesh)
      model = build_model(arch, data.num_classes, feature_dim, rm, self.conv, companion=algorithm.companion)
      self.groups.append(Group(arch, model, ids,
                               place(data.group_train(ids)), EvalSet(place(data.group_test(ids)), shared=False)))
    if self.global_test is None and not any(g.test.sizes.sum() > 0 for g in self.groups):
      raise ConfigError('--train_fraction: no client has local test rows and there is no global test set, so '
                        'nothing can be evaluated. Fix: --train_fraction < 1 or --eval_protocol=global.')
    self.train_sizes = np.zeros(self.num_clients, int)  # per global client id, host copy
    for g in self.groups:
      g.num_params, g.num_companion_params = _check_architecture(g.model, g.arch, g.train.x.shape[2:],
                                                                 algorithm.companion)
      self.train_sizes[g.clients] = g.train_sizes
      g.stat_sizes = np.asarray(training.statistics_rows(g.train_sizes))  # rows of its statistics passes
    # Participant slots per group: fixed across rounds (no recompiles), a multiple of the device count.
    self.slots = [-(-min(g.size, self.num_join) // num_devices) * num_devices for g in self.groups]
    self._warn_small_clients(training.batch_size)
    self._compiled: dict = {}
    self._head_names: Optional[list[str]] = None
    self._comm: Optional[list[dict]] = None

  def _warn_small_clients(self, batch_size: int) -> None:
    small = [int(k) for g in self.groups for k, n in zip(g.clients, g.train_sizes) if n < batch_size]
    if small:
      logging.warning('--batch_size=%d: clients %s have fewer training samples than one batch and take no local '
                      'step (one epoch drops the last partial batch, as HtFLlib does).', batch_size, small)

  # ---------------------------------------------------------------- initialisation
  def init(self) -> FederationState:
    """Initial client states and server state.

    With `shared_init` (HtFLlib) every client of an architecture starts from the same parameters, drawn from a
    key of the seed and the architecture's name; otherwise each client draws its own. `init='torch'` redraws
    Conv/Dense layers with PyTorch's defaults (`models.init`). A method that averages whole models within a group
    (`group_update`) starts each group from one model even without `shared_init`, as PFLlib broadcasts the global
    model before the first local step.
    """
    root = jax.random.PRNGKey(self.seed)
    init_key, key_key, server_key = jax.random.split(root, 3)
    states = []
    for g in self.groups:
      sample = jnp.zeros((1,) + g.train.x.shape[2:], g.train.x.dtype)

      def init_one(k, g=g, sample=sample):
        variables = g.model.init(k, sample, train=False)
        params = variables.pop('params')
        if self.init_scheme == 'torch':
          params = torch_default_init(params, jax.random.fold_in(k, 1))
        return params, variables

      if self.shared_init or self.algorithm.group_update is not None:
        group_key = (architecture_key(init_key, g.arch) if self.shared_init
                     else jax.random.fold_in(init_key, int(g.clients[0])))
        init_keys = jnp.broadcast_to(group_key, (g.stacked_size,) + group_key.shape)
      else:
        init_keys = jax.vmap(lambda c: jax.random.fold_in(init_key, c))(g.stacked_ids)
      params, variables = jax.jit(jax.vmap(init_one))(init_keys)
      keys = jax.vmap(lambda c: jax.random.fold_in(key_key, c))(g.stacked_ids)
      states.append(place_clients(ClientState(params, dict(variables), keys), self.mesh))
    example = jax.tree.map(lambda a: jnp.asarray(to_host(a[0])), states[0].params)
    server = self.algorithm.init_server(server_key, example)
    return FederationState(tuple(states), server, jnp.asarray(0, jnp.int32))

  # ---------------------------------------------------------------- sampling and accounting
  def participants(self, round_index: int) -> np.ndarray:
    """Ascending ids of the clients that train in `round_index` (num_join of them, drawn without replacement)."""
    if self.num_join == self.num_clients:
      return np.arange(self.num_clients)
    rng = np.random.default_rng([self.seed, round_index, 0x5A])
    return np.sort(rng.choice(self.num_clients, self.num_join, replace=False))

  def communication_per_client(self) -> list[dict]:
    """Per-client upload/broadcast scalars by part, from the algorithm's accounting."""
    if self._comm is None:
      params, companion = np.zeros(self.num_clients, int), np.zeros(self.num_clients, int)
      for g in self.groups:
        params[g.clients] = g.num_params
        companion[g.clients] = g.num_companion_params
      feature_dim = self.groups[0].model.feature_dim
      present = (np.asarray(self.data.split.train_class_counts) > 0).sum(1)
      self._comm = [self.algorithm.communication(CommSpec(self.data.num_classes, feature_dim,
                                                          int(self.train_sizes[k]), int(params[k]),
                                                          int(present[k]), int(companion[k])))
                    for k in range(self.num_clients)]
    return self._comm

  def local_work(self, participants: np.ndarray) -> dict:
    """SGD steps and training samples the participants process this round: epochs * (n_k // batch_size) steps
    of batch_size rows each (drop_last), summed over participants."""
    steps = int((self.train_sizes[participants] // self.training.batch_size).sum()) * self.training.epochs
    return {'local_steps': steps, 'local_samples': steps * self.training.batch_size}

  def round_communication(self, participants: np.ndarray) -> dict:
    """Scalars uploaded and broadcast this round, summed over participants, in total and by part."""
    comm = self.communication_per_client()
    out = {}
    for direction in ('upload', 'broadcast'):
      parts: dict = {}
      for k in participants:
        for part, v in comm[k][direction].items():
          parts[part] = parts.get(part, 0) + int(v)
      out[f'{direction}_scalars'] = sum(parts.values())
      out.update({f'{direction}_{part}_scalars': v for part, v in parts.items()})
    return out

  # ---------------------------------------------------------------- one round
  def round(self, state: FederationState) -> tuple[FederationState, dict]:
    """One communication round (fedre.txt Alg. 1 lines 5-13 for FedRE); returns the new state and metrics.

    Metrics: round, train_loss (mean over participants of their mean local-step loss), participants,
    local_steps and local_samples (`local_work`), the server's metrics, upload/broadcast scalars (total and by
    part) and train_seconds.
    """
    start = time.perf_counter()
    r = int(state.round)
    key, server_key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(self.seed), r + 1))
    participants = self.participants(r)
    broadcast = self.algorithm.broadcast(state.server)
    groups, uploads, masks, losses = [], [], [], []
    for gi, g in enumerate(self.groups):
      local = np.flatnonzero(np.isin(g.clients, participants))
      slot_idx = np.full(self.slots[gi], g.stacked_size, np.int32)  # empty slots point past the stack
      slot_idx[:len(local)] = local
      update = self._vmap_group if self.strategy == 'vmap' else self._sequential_group
      stacked, up, loss = update(gi, state.groups[gi], slot_idx, broadcast, key)
      if self.algorithm.group_update is not None:
        participated = jnp.asarray(np.isin(np.arange(g.stacked_size), local))
        stacked = self._jit('group_update', gi, lambda: jax.jit(self._group_step, donate_argnums=0))(
            stacked, participated, g.train.n)
      groups.append(stacked)
      uploads.append(up)
      masks.append(slot_idx < g.size)
      losses.append((loss, slot_idx < g.size))
    mask = jnp.asarray(np.concatenate(masks))
    server_update = self._jit('server', None, lambda: jax.jit(self.algorithm.server_update))
    server, server_metrics = server_update(state.server, concat_uploads(uploads), mask, server_key)
    new_state = FederationState(tuple(groups), server, state.round + 1)
    losses = np.concatenate([to_host(loss)[real] for loss, real in losses])  # host reads after all dispatches
    metrics = {'round': r + 1, 'train_loss': float(np.mean(losses)),
               'participants': len(participants), **self.local_work(participants)}
    metrics.update(self.round_communication(participants))
    # Measured communication (FedKD's SVD ranks, FPL's cluster counts) replaces the static accounting.
    metrics.update({k: float(v) for k, v in server_metrics.items()})
    jax.block_until_ready(new_state)
    metrics['train_seconds'] = time.perf_counter() - start
    return new_state, metrics

  def _group_step(self, stacked: ClientState, participated, num_train) -> ClientState:
    params, model_state = self.algorithm.group_update(stacked.params, stacked.model_state, participated, num_train)
    return stacked._replace(params=params, model_state=model_state)

  def _jit(self, name: str, gi: Optional[int], make):
    if (name, gi) not in self._compiled:
      self._compiled[(name, gi)] = make()
    return self._compiled[(name, gi)]

  # ---------------------------------------------------------------- strategy: vmap
  def _vmap_group(self, gi: int, stacked: ClientState, slot_idx: np.ndarray, broadcast, key):
    g = self.groups[gi]
    if self.num_join == self.num_clients and not self.chunk_size:
      # Full participation: the slots are the (padded) group itself, so no gather/scatter copies.
      update = self._jit('vmap_update_full', gi, lambda: jax.jit(self._make_vmap_update(g, full=True),
                                                                 donate_argnums=0))
      return update(stacked, g.train, jnp.asarray(slot_idx), g.stacked_ids, broadcast, key)
    chunk = self.chunk_size or len(slot_idx)
    pad = (-len(slot_idx)) % chunk
    slot_idx = np.concatenate([slot_idx, np.full(pad, g.stacked_size, np.int32)])
    update = self._jit('vmap_update', gi, lambda: jax.jit(self._make_vmap_update(g, full=False), donate_argnums=0))
    uploads, losses = [], []
    for c in range(0, len(slot_idx), chunk):
      stacked, up, loss = update(stacked, g.train, jnp.asarray(slot_idx[c:c + chunk]), g.stacked_ids, broadcast,
                                 key)
      uploads.append(up)
      losses.append(loss)
    keep = len(slot_idx) - pad
    cat = lambda *a: jnp.concatenate(a)[:keep]
    return stacked, jax.tree.map(cat, *uploads), jnp.concatenate(losses)[:keep]

  def _make_vmap_update(self, g: Group, full: bool):
    update_one = lambda c, d, b, k: client_update(self.algorithm, g.model, self.training, c, d, b, k,
                                                  self.eval_batch_size, self.scan_unroll)

    def update(stacked, train, slot_idx, client_ids, broadcast, key):
      if full:  # the slots are the stacked group in order
        clients, data, ids = stacked, train, client_ids
      else:
        clients, data = _take(stacked, slot_idx), _take(train, slot_idx)
        ids = jnp.take(client_ids, slot_idx, mode='clip')
      rngs = jax.vmap(lambda c: jax.random.fold_in(key, c))(ids)
      new, uploads, metrics = jax.vmap(update_one, in_axes=(0, 0, None, 0))(clients, data, broadcast, rngs)
      if full:
        return new, uploads, metrics['train_loss']
      stacked = jax.tree.map(lambda a, b: a.at[slot_idx].set(b, mode='drop'), stacked, new)
      return stacked, uploads, metrics['train_loss']
    return update

  # ---------------------------------------------------------------- strategy: sequential
  def _sequential_group(self, gi: int, stacked: ClientState, slot_idx: np.ndarray, broadcast, key):
    g = self.groups[gi]
    fns = self._jit('sequential', gi, lambda: self._make_sequential_fns(g))
    n_max = g.train.x.shape[1]
    real = [int(i) for i in slot_idx if i < g.size]
    uploads, losses = [], []
    # Waves of `client_threads` clients run concurrently (one host thread each: XLA:CPU then uses every core);
    # each client's update is independent of the others, so the numbers do not depend on the thread count.
    for w in range(0, len(real), self.client_threads):
      wave = real[w:w + self.client_threads]
      taken = [fns['take'](stacked, i) for i in wave]
      run = lambda a: self._sequential_client(g, fns, a[0], a[1], broadcast, key)
      done = list(self._pool().map(run, zip(wave, taken))) if len(wave) > 1 else [run((wave[0], taken[0]))]
      for i, (client, upload, loss) in zip(wave, done):
        stacked = fns['put'](stacked, i, client)
        uploads.append(upload)
        losses.append(loss)
    # Uploads are laid out in the same fixed slots as the vmap strategy, padded slots zero.
    if 'empty_upload' not in fns:
      client = jax.eval_shape(fns['take'], stacked, 0)
      if self.algorithm.train_statistics:
        reps = jax.eval_shape(fns['carry_init'], client.params, client.model_state, broadcast)[3]
      else:
        reps = jax.ShapeDtypeStruct((n_max, g.model.feature_dim if self.algorithm.needs_representations else 0),
                                    jnp.float32)
      template = jax.eval_shape(fns['upload'], client, reps, g.train.y, 0, broadcast, jax.random.PRNGKey(0))
      fns['empty_upload'] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), template)
    zeros = fns['empty_upload']
    padded = uploads + [zeros] * (len(slot_idx) - len(uploads))
    losses = losses + [0.0] * (len(slot_idx) - len(losses))
    return stacked, jax.tree.map(lambda *a: jnp.stack(a), *padded), jnp.asarray(losses, jnp.float32)

  def _sequential_client(self, g: Group, fns: dict, i: int, client: ClientState, broadcast, key):
    """Client i's round from the host: begin, its real local steps, representations, upload."""
    n_max, b, epochs = g.train.x.shape[1], self.training.batch_size, self.training.epochs
    rng = jax.random.fold_in(key, int(g.clients[i]))
    client = fns['begin'](client, broadcast)
    train_rng = jax.random.fold_in(rng, 1)
    idx, _ = fns['schedule'](jax.random.fold_in(train_rng, 0), g.train.n[i])
    carry = fns['carry_init'](client.params, client.model_state, broadcast)
    total, steps = 0.0, 0
    for e in range(epochs):
      for s in range(g.train_sizes[i] // b):
        carry, loss = fns['step'](carry, g.train.x, g.train.y, i, idx, e * (n_max // b) + s, e, s, train_rng,
                                  broadcast)
        total, steps = total + loss, steps + 1
    client = client._replace(params=carry[0], model_state=carry[1])
    if self.algorithm.train_statistics:
      reps = carry[3]
    elif self.algorithm.needs_representations:
      reps = self._represent_sequential(g, fns, client, g.train.x, g.stat_sizes[i], i)[1]
    else:
      reps = jnp.zeros((n_max, 0))
    upload = fns['upload'](client, reps, g.train.y, i, broadcast, jax.random.fold_in(rng, 2))
    return client, upload, total / max(steps, 1)

  def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
    if self._threads is None:
      self._threads = concurrent.futures.ThreadPoolExecutor(self.client_threads, thread_name_prefix='client')
    return self._threads

  def _represent_sequential(self, g: Group, fns, client: ClientState, x_all: jnp.ndarray, size: int, i: int):
    """Eval-mode (logits, representations) of block i of x_all, chunk by chunk over its `size` real rows."""
    n_max = x_all.shape[1]
    chunk = _even_chunk(n_max, self.eval_batch_size)
    buf = (jnp.zeros((n_max, g.model.num_classes)), jnp.zeros((n_max, g.model.feature_dim)))
    for start in range(0, max(int(size), 1), chunk):
      buf = fns['represent_into'](buf, client, x_all, i, start)
    return buf

  def _make_sequential_fns(self, g: Group) -> dict:
    alg, model, training = self.algorithm, g.model, self.training
    optimizer = training.optimizer()
    chunk = _even_chunk(g.train.x.shape[1], self.eval_batch_size)

    loss_fn = lambda broadcast: lambda p, st, x, y, r: alg.client_loss(model, p, st, x, y, broadcast, r)

    def step(carry, x_all, y_all, i, schedule, slot, epoch, s, rng, broadcast):
      batch = schedule[slot]
      return sgd_step(loss_fn(broadcast), optimizer, carry, x_all[i, batch], y_all[i, batch], jnp.asarray(True),
                      step_key(rng, epoch, s))

    def carry_init(params, model_state, broadcast):
      return initial_carry(loss_fn(broadcast), optimizer, params, model_state, g.train.x[0], g.train.y[0],
                           training.batch_size, alg.train_statistics)

    def upload(client, reps, y_all, i, broadcast, rng):
      return alg.client_upload(client, reps, y_all[i], training.statistics_rows(g.train.n[i]), broadcast, rng,
                               g.train.n[i])

    n_max, b, e = g.train.x.shape[1], training.batch_size, training.epochs
    return {
        'take': jax.jit(lambda stacked, i: jax.tree.map(lambda a: a[i], stacked)),
        'put': jax.jit(lambda stacked, i, c: jax.tree.map(lambda a, v: a.at[i].set(v), stacked, c),
                       donate_argnums=0),
        'begin': jax.jit(alg.client_begin),
        'carry_init': jax.jit(carry_init),
        'schedule': jax.jit(lambda rng, n: batch_schedule(rng, n, n_max, b, e, training.order)),
        'step': jax.jit(step),
        'represent_into': _represent_into(model, chunk),
        'upload': jax.jit(upload),
    }

  # ---------------------------------------------------------------- evaluation
  def evaluate(self, state: FederationState) -> dict:
    """Accuracy of every client with each of the algorithm's eval heads.

    Per head: sample-weighted sum(correct)/sum(n) over all clients (HtFLlib's metric), the per-client mean and
    std, and (first head) the per-client accuracies. The unprefixed metrics follow the evaluation protocol: local
    test splits ('pooled') or the global test set ('global'); when both exist (global protocol with
    train_fraction < 1) the other is logged with prefix 'local_test_' or 'global_test_'.
    """
    broadcast = self.algorithm.broadcast(state.server)
    has_local = any(g.test.sizes.sum() > 0 for g in self.groups)
    local = self._evaluate_set(state, broadcast, 'local') if has_local else None
    glob = self._evaluate_set(state, broadcast, 'global') if self.global_test is not None else None
    primary, secondary, prefix = ((glob, local, 'local_test_') if self.data.protocol == 'global'
                                  else (local, glob, 'global_test_'))
    out = _accuracy_metrics(*primary, prefix='', per_client=True)
    if secondary is not None:
      out.update(_accuracy_metrics(*secondary, prefix=prefix, per_client=False))
    return out

  def _evaluate_set(self, state: FederationState, broadcast, which: str) -> tuple[dict, np.ndarray]:
    correct = {name: np.zeros(self.num_clients) for name in self._eval_head_names(state, broadcast)}
    counts = np.zeros(self.num_clients)
    for gi, g in enumerate(self.groups):
      es = g.test if which == 'local' else self.global_test
      if self.strategy == 'vmap':
        fn = self._jit(f'vmap_eval_{which}', gi, lambda: jax.jit(self._make_vmap_eval(g, es.shared)))
        scores = fn(state.groups[gi], es.arrays, broadcast)
      else:
        scores = self._sequential_eval(gi, state.groups[gi], broadcast, es, which)
      counts[g.clients] = [es.sizes[es.index(i)] for i in range(g.size)]
      for name, c in scores.items():
        correct[name][g.clients] = to_host(c)[:g.size]
    return correct, counts

  def _eval_head_names(self, state: FederationState, broadcast) -> list[str]:
    """The algorithm's eval heads in its own order (the first is the reported one; pytree maps sort dict keys,
    so the order is read while tracing `eval_heads` abstractly, once)."""
    if self._head_names is None:
      names: list[str] = []
      record = lambda stacked, b: names.extend(self.algorithm.eval_heads(jax.tree.map(lambda a: a[0], stacked), b))
      jax.eval_shape(record, state.groups[0], broadcast)
      self._head_names = names
    return self._head_names

  def _score(self, g: Group, client: ClientState, reps, y, n, broadcast) -> dict:
    valid = jnp.arange(y.shape[0]) < n
    heads = self.algorithm.eval_heads(client, broadcast)
    return {name: jnp.sum((jnp.argmax(head_logits(g.model, h, reps), -1) == y) & valid)
            for name, h in heads.items()}

  def _as_evaluated(self, client: ClientState, broadcast) -> ClientState:
    eval_client = self.algorithm.eval_client
    return client if eval_client is None else eval_client(client, broadcast)

  def _make_vmap_eval(self, g: Group, shared: bool):
    def score(c, t, broadcast):
      c = self._as_evaluated(c, broadcast)
      reps = represent_rows(g.model, c.params, c.model_state, t.x, self.eval_batch_size)[1]
      return self._score(g, c, reps, t.y, t.n, broadcast)

    def evaluate(stacked, test, broadcast):
      fn = lambda c, t: score(c, t, broadcast)
      if shared:
        return jax.vmap(fn, in_axes=(0, None))(stacked, jax.tree.map(lambda a: a[0], test))
      return jax.vmap(fn)(stacked, test)
    return evaluate

  def _sequential_eval(self, gi: int, stacked: ClientState, broadcast, es: EvalSet, which: str) -> dict:
    g = self.groups[gi]
    chunk = _even_chunk(es.arrays.x.shape[1], self.eval_batch_size)
    fns = self._jit(f'sequential_eval_{which}', gi, lambda: {
        'represent_into': _represent_into(g.model, chunk),
        'score': jax.jit(lambda c, reps, y_all, j, n_all, b: self._score(g, c, reps, y_all[j], n_all[j], b))})
    take = self._jit('sequential', gi, lambda: self._make_sequential_fns(g))['take']
    results = []
    as_evaluated = self._jit('as_evaluated', gi, lambda: jax.jit(self._as_evaluated))
    for i in range(g.size):
      client = take(stacked, i)
      if self.algorithm.eval_client is not None:
        client = as_evaluated(client, broadcast)
      j = es.index(i)
      _, reps = self._represent_sequential(g, fns, client, es.arrays.x, es.sizes[j], j)
      results.append(fns['score'](client, reps, es.arrays.y, j, es.arrays.n, broadcast))
    return jax.tree.map(lambda *a: jnp.stack(a), *results)


def _accuracy_metrics(correct: dict, counts: np.ndarray, prefix: str, per_client: bool) -> dict:
  """Sample-weighted accuracy, per-client mean/std (clients with test rows) and, optionally, per-client values."""
  out = {}
  has_data = counts > 0
  for j, (name, c) in enumerate(correct.items()):
    per = c[has_data] / counts[has_data]
    head = prefix if j == 0 else f'{prefix}{name}_'
    out[f'{head}accuracy'] = float(c.sum() / max(counts.sum(), 1))
    out[f'{head}client_accuracy_mean'] = float(per.mean())
    out[f'{head}client_accuracy_std'] = float(per.std())
    if j == 0 and per_client:
      out['eval_head'] = name
      out['client_accuracy'] = [float(a) for a in c / np.maximum(counts, 1)]
  return out
