"""The vocabulary shared by the engine and the algorithms (neither imports the other): client state, what an
algorithm knows about the federation, and the algorithm API.

An `Algorithm` is pure functions in optax's style. Its clients run a `ClientProgram` (init / step / final on ONE
client), built per architecture group, which every executor runs unchanged: vmapped over a group with the local
steps in a `lax.scan`, or client by client from the host. A run is a sequence of `Phase`s (each with its own
program, server step, broadcast, rounds and participation); state, round counter, logs and checkpoints continue
across phase boundaries. Communication is measured from what crosses: the leaf sizes of each participant's upload
and of the broadcast its group receives (each phase's `Traffic`, overridable where part of a fixed-shape array is
padding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Protocol, Sequence

import jax
import jax.numpy as jnp

from fedjax_het.local_training import LocalTraining
from fedjax_het.uploads import RoundUploads, Uploads, parts, with_parts  # noqa: F401 (part of the API here)

# A method's own records (NamedTuples declared in its module, one field per part; see `parts`): its broadcast, its
# clients' upload, its server state and a program's carry.
Broadcast = Any
Upload = Any
ServerState = Any
Carry = Any


class ClientState(NamedTuple):
  """One client's state; stacked over a group, every leaf gets a leading client axis.

  params: its classifier's flax params {'extractor': ..., ['rm_fc': ...], 'head': ...}.
  model_state: the classifier's non-trainable collections, e.g. {'batch_stats': ...}; {} without BatchNorm.
  extra: the algorithm's per-client state (`Algorithm.init_client`): extra modules' variables, optimizer states
    kept across rounds, ...; checkpointed with the rest, never averaged unless the algorithm does it.
  key: a uint32[2] key fixed at initialisation (draws that must not change across rounds).
  """
  params: Any
  model_state: Any
  extra: Any
  key: jax.Array


class Batch(NamedTuple):
  """One local step's rows: x [B, ...], y [B], and index [B], the rows' indices in the client's training rows.
  A program that trains on rows it generates (`LocalTraining.rows`) gets x and y None and index its row ids.
  mask [B]: which rows are real when the schedule keeps a partial last batch (`LocalTraining.drop_last` False;
  None: every row is real). A program that accepts such batches (`Capabilities.partial_batches`) averages its losses
  over the real rows and runs its classifier inside `models.norm.batch_rows(mask)`."""
  x: Optional[jnp.ndarray]
  y: Optional[jnp.ndarray]
  index: Optional[jnp.ndarray] = None
  mask: Optional[jnp.ndarray] = None


class ClientRows(NamedTuple):
  """What a client's `final` sees of its data: all its padded training rows x [n_max, ...], y [n_max]; n, the
  rows a statistics pass over its train loader visits (its first n; HtFLlib's drop_last loader under the stored
  order, `LocalTraining.statistics_rows`); num_train, all its training rows; reps [n_max, d], eval-mode
  representations of the rows by the trained model (only for programs with `trained`; rows past n are padding);
  statistics: sums a program gathered in its training passes (set by the program itself, see `sgd_program`)."""
  x: jnp.ndarray
  y: jnp.ndarray
  n: jnp.ndarray
  num_train: jnp.ndarray
  reps: Optional[jnp.ndarray] = None
  statistics: Any = None


class Stage(NamedTuple):
  """A stretch of a client's local loop with its own step function.

  step(carry, batch, broadcast, key) -> (carry, loss): one local step on a `Batch` (the program may also, or
  instead, train on batches it generates); epochs: how many epochs; generated: whether its batches are ones the
  program generates itself (`Batch(None, None, None, mask)`, e.g. GeFL's target training on generator samples),
  max(1, n // batch_size) steps per epoch for a client of n rows; otherwise epochs of the client's real rows (or of
  the program's generated rows, `LocalTraining.rows`) as `ClientProgram.training` schedules them. (The broadcast
  is an argument rather than part of the carry so that vmapped clients share one copy.)
  training: the stage's own schedule (None: the program's `ClientProgram.training`), e.g. FedMD's digest over the
  server's P public rows, `LocalTraining(rows=P, ...)`: every client then takes epochs * (P // B) steps whose
  `Batch.index` names public rows, under the stage's own batch size and step cap (`LocalTraining.max_steps`).
  """
  step: Callable[[Any, Batch, Any, jax.Array], tuple[Any, jnp.ndarray]]
  epochs: int
  generated: bool = False
  training: Optional[LocalTraining] = None


class ClientProgram(NamedTuple):
  """One client's round as pure functions; every executor runs exactly these (`engine.plan`).

  init(client, broadcast, key) -> carry: receive the broadcast, build the optimizer state(s).
  stages: the local loop, `Stage`s run in order (a single-loss method has one: `single_stage`; GeFL's target
    round has T_s epochs on generated batches, then T_r on real rows, then T_g of generator training). The
    executor runs only the step slots a client takes.
  final(carry, rows, broadcast, key) -> (client, upload): statistics passes and the upload (a fixed-shape pytree).
  training: the local schedule: batch size, order, batching rule, generated rows and step cap of the stages.
  trained: (carry) -> the trained `ClientState`, when `final` reads `rows.reps` (the executor computes the
    eval-mode representations of the training rows with the group's model its fastest way); None otherwise.
  identity: None for a program of its group; a hashable value for a program that reads nothing of the group's
    classifier (GeFL's generator training), equal for every group whose program computes the same functions (e.g.
    the generator's configuration and the input shape). Such a program gets the client with params and
    model_state None, which the executor puts back after `final`, and is compiled once for all those groups.
  prepare(client, rows, broadcast, key) -> client: a pass over the client's rows (`ClientRows` without
    representations or statistics) before `init`, for a method that sets the client up from its data before the
    local loop (FedALA's adaptive local aggregation of the received model); None: none.
  representation_weights(carry, rows, broadcast, key) -> W [rows, K]: for a program with `trained` whose `final`
    reads the representations only through K weighted sums (FedRE's entangled representation): `final` then gets
    rows.reps = W^T R [K, d], which the vmap executor adds up pass by pass instead of holding every row's
    representation; `rows` holds no representations, `key` is the one `final` gets. None: rows.reps is R.
  """
  init: Callable[[ClientState, Broadcast, jax.Array], Carry]
  stages: tuple[Stage, ...]
  final: Callable[[Carry, ClientRows, Broadcast, jax.Array], tuple[ClientState, Upload]]
  training: LocalTraining
  trained: Optional[Callable[[Carry], ClientState]] = None
  identity: Any = None
  prepare: Optional[Callable[[ClientState, ClientRows, Broadcast, jax.Array], ClientState]] = None
  representation_weights: Optional[Callable[[Carry, ClientRows, Broadcast, jax.Array], jnp.ndarray]] = None


def single_stage(step: Callable[[Any, Batch, Any, jax.Array], tuple[Any, jnp.ndarray]], training: LocalTraining
                 ) -> tuple[Stage, ...]:
  """The stages of a program with one step over `training.epochs` epochs of the client's rows."""
  return (Stage(step, training.epochs),)


def without_model(program: ClientProgram, client: ClientState) -> ClientState:
  """What `program` receives of a client: the client, or for a program that reads nothing of the classifier
  (`ClientProgram.identity` set) the client with params and model_state None."""
  return client if program.identity is None else client._replace(params=None, model_state=None)


def with_model(program: ClientProgram, client: ClientState, original: ClientState) -> ClientState:
  """A program's returned client with the classifier of `original` put back when the program does not read it."""
  return client if program.identity is None else client._replace(params=original.params,
                                                                  model_state=original.model_state)


class Evaluation(NamedTuple):
  """How a group's clients are scored: names of the scored predictions, the first being the method's reported
  accuracy; prepare(client, broadcast) -> evaluated (once per client and evaluation: the model as evaluated, its
  heads); logits(evaluated, x) -> one [B, C] array per name, on a batch of test rows, or with `batch_rows`
  logits(evaluated, x, rows), rows [B] marking the batch's real test rows (a model normalised by each test batch's
  own statistics, HeteroFL's, must not count padding). Evaluation never trains.

  statistics(evaluated, x, rows) -> a pytree of sums over a batch x of one client's training rows (rows [B]: the
  real ones; batches of the run's batch size of the client's rows shuffled, augmented as its training batches, a
  train loader's, drawn from the round's key: `engine.plan.statistics_key`); where set, the engine adds them up over
  every client's training rows before scoring (the server querying each client: HeteroFL's static BatchNorm), and
  prepare takes them as a third argument: prepare(client, broadcast, totals), totals None while the statistics
  themselves are gathered (`prepare_evaluation`)."""
  names: tuple[str, ...]
  prepare: Callable[[ClientState, Broadcast], Any]
  logits: Callable[..., tuple[jnp.ndarray, ...]]
  batch_rows: bool = False
  statistics: Optional[Callable[[Any, jnp.ndarray, jnp.ndarray], Any]] = None


class Gathered(NamedTuple):
  """A group's broadcast with the totals of its evaluation's statistics (`Evaluation.statistics`), as the engine
  hands it to the executors that score the clients."""
  broadcast: Any
  statistics: Any


def prepare_evaluation(evaluation: Evaluation, client: ClientState, broadcast: Any) -> Any:
  """`evaluation.prepare` of the client: prepare(client, broadcast), or for an evaluation with statistics
  prepare(client, broadcast, totals), the totals those of a `Gathered` broadcast (None while they are gathered)."""
  if evaluation.statistics is None:
    return evaluation.prepare(client, broadcast)
  if isinstance(broadcast, Gathered):
    return evaluation.prepare(client, broadcast.broadcast, broadcast.statistics)
  return evaluation.prepare(client, broadcast, None)


class ModelMaker(Protocol):
  """How a run builds and initialises classifiers and modules (the engine provides it: `engine.groups`)."""

  def build(self, arch: str, feature_dim: int) -> Any:
    """A registered architecture built as the run builds its clients' (RM, convolutions)."""

  def init(self, module: Any, key: jax.Array, *inputs: Any, path: tuple) -> dict:
    """A module's variables initialised as the run initialises its clients (--init)."""

  def init_with_output(self, module: Any, key: jax.Array, *inputs: Any, path: tuple) -> tuple[Any, dict]:
    """(the module's outputs on `inputs`, its variables as `init` draws them)."""

  def shared_key(self, name: str) -> jax.Array:
    """A key of the run's seed and `name` only."""


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """What an algorithm knows about one architecture group. model: the group's classifier (a flax module with
  `represent` and `head`, `models.classifier.HeteroClassifier`); maker: how the run builds and initialises
  modules (`build_model`, `init_module`, `shared_key`); group_models: every group's classifier in group order (a
  program that runs the other groups' models reads them: AvgKD's teachers); train_rows: the padded training rows of
  each client (n_max, the group's longest client's; a server keeping something per row sizes it by this)."""
  index: int
  arch: str
  model: Any
  clients: tuple[int, ...]
  num_classes: int
  feature_dim: int
  input_shape: tuple[int, ...]
  training: LocalTraining
  maker: ModelMaker
  rm: str = 'ap'
  conv: str = 'xla'
  group_models: tuple = ()
  train_rows: int = 0

  def build_model(self, arch: str, feature_dim: Optional[int] = None) -> Any:
    """A registered architecture built the way this run builds its clients' (RM, convolutions), with RM to
    `feature_dim` (default the run's d): e.g. the small global model of FML, FedKD and FedMRL."""
    return self.maker.build(arch, feature_dim or self.feature_dim)

  def init_module(self, module: Any, key: jax.Array, *inputs: Any, name: str) -> dict:
    """A module's variables initialised as this run initialises its clients (--init): `name` is the module's
    place in the client ('companion', 'hidden_map', ...), which keys its PyTorch-style draws."""
    return self.maker.init(module, key, *inputs, path=(name,))

  def shared_key(self, name: str) -> jax.Array:
    """A key of the run's seed and `name` only, the same in every group: for modules that all clients of all
    architectures must start from identically (a shared decoder or generator)."""
    return self.maker.shared_key(name)

  def sample_input(self, rows: int = 1) -> jnp.ndarray:
    """Zeros shaped like `rows` input images (for initialising modules that read images)."""
    return jnp.zeros((rows,) + tuple(self.input_shape))


@dataclasses.dataclass(frozen=True)
class FederationSpec:
  """What an algorithm's server knows: classes, d, clients, groups, rounds and the local schedule."""
  num_classes: int
  feature_dim: int
  num_clients: int
  rounds: int
  groups: tuple[GroupSpec, ...]
  training: LocalTraining


def whole_server(server: ServerState, group: GroupSpec) -> Broadcast:
  """The broadcast of methods that send their whole server state to every group."""
  return server


class PerClient(NamedTuple):
  """A part of a broadcast that the server sends each client alone (FedGKT's server logits of the client's rows):
  values, whose leaves carry a leading axis over the group's clients in group order. A client reads its own
  slice, still wrapped (`for_client`); a method declares one by placing it in its broadcast record."""
  values: Any


def _is_per_client(node: Any) -> bool:
  return isinstance(node, PerClient)


def has_per_client(broadcast: Broadcast) -> bool:
  """Whether `broadcast` holds a `PerClient` part."""
  return any(_is_per_client(n) for n in jax.tree.leaves(broadcast, is_leaf=_is_per_client))


def map_per_client(fn: Callable[[Any], Any], broadcast: Broadcast) -> Broadcast:
  """`broadcast` with every `PerClient` part's values replaced by fn(values)."""
  return jax.tree.map(lambda n: PerClient(fn(n.values)) if _is_per_client(n) else n, broadcast,
                      is_leaf=_is_per_client)


def per_client_axes(broadcast: Broadcast) -> Any:
  """vmap's in_axes for `broadcast` with its `PerClient` parts gathered per slot: 0 on their leaves, None (shared)
  elsewhere."""
  return jax.tree.map(lambda n: jax.tree.map(lambda _: 0, n) if _is_per_client(n) else None, broadcast,
                      is_leaf=_is_per_client)


def for_client(broadcast: Broadcast, i) -> Broadcast:
  """What client i (its index in its group) reads of its group's `broadcast`: the broadcast itself, with every
  `PerClient` part cut to client i's slice. Every executor and the Flower server hand programs and evaluations
  this, never the others' slices."""
  if not has_per_client(broadcast):
    return broadcast
  return map_per_client(lambda v: jax.tree.map(lambda a: jnp.take(a, i, axis=0, mode='clip'), v), broadcast)


def leaf_scalars(tree: Any) -> dict:
  """Scalars per part (`parts`: a NamedTuple's fields or a dict's keys; else one part 'all', none without
  leaves): the sizes of its leaves."""
  count = lambda t: sum(math.prod(jnp.shape(a)) for a in jax.tree.leaves(t))
  if isinstance(tree, dict) or hasattr(tree, '_asdict'):
    return {k: count(v) for k, v in parts(tree).items()}
  return {'all': count(tree)} if jax.tree.leaves(tree) else {}


class Traffic(NamedTuple):
  """How a phase's communication is counted, per participant and part (`leaf_scalars` by default: every leaf of
  what crosses; a method overrides where part of a fixed-shape array is padding or a data-dependent size).

  upload(upload) -> {part: scalars} of one client's upload; broadcast(broadcast) -> {part: scalars} of what one
  participant receives; received(broadcast, upload) -> {part: scalars} that one participant receives when it
  depends on the participant (FedVTC sends prototype c^y only to holders of y, which its upload shows), None: the
  broadcast's count. jnp scalars are allowed (data-dependent sizes)."""
  upload: Callable[[Upload], dict] = leaf_scalars
  broadcast: Callable[[Broadcast], dict] = leaf_scalars
  received: Optional[Callable[[Broadcast, Upload], dict]] = None


@dataclasses.dataclass(frozen=True)
class Phase:
  """A stretch of rounds with one client program and server step.

  client(group) -> the `ClientProgram` of that group's clients; server_update(server, uploads, key) -> (server,
  metrics), uploads the round's `RoundUploads` (one `Uploads` per group, with reductions over the participants:
  `server_step` gathers them); broadcast(server, group) -> what that group's participants receive (a `PerClient`
  part in it reaches each client of the group as its own slice: `for_client`). rounds: how many (None: the rest of
  the run); join_ratio: participation (None: the run's); evaluate: whether the run's evaluation schedule applies
  in this phase. server_of_spec: server_update is (spec: FederationSpec) -> the server step, for a
  server that runs the groups' classifiers (FedDF distils into them); `server_step` gives the step either way.
  runs_without_participants: whether the server step runs in a round whose Poisson draw took nobody (a DP step
  with a fixed denominator, whose release must not tell such a round apart); otherwise such a round leaves the
  server as it was. traffic: how the phase's uploads and broadcasts are counted (`Traffic`).
  with_constants(broadcast, constants) -> what the group's programs and evaluation read: the broadcast with what
  they need of the algorithm's constants (`Algorithm.constants`: FedMD's public rows), which every client holds
  and nobody sends (traffic counts the broadcast alone); None: the broadcast as sent.
  """
  name: str
  client: Callable[[GroupSpec], ClientProgram]
  server_update: Callable[..., tuple[ServerState, dict]]
  broadcast: Callable[[ServerState, GroupSpec], Broadcast] = whole_server
  rounds: Optional[int] = None
  join_ratio: Optional[float] = None
  evaluate: bool = True
  server_of_spec: bool = False
  runs_without_participants: bool = False
  traffic: Traffic = Traffic()
  with_constants: Optional[Callable[[Broadcast, Any], Broadcast]] = None


def server_step(phase: Phase, spec: FederationSpec) -> Callable[..., tuple[ServerState, dict]]:
  """The phase's server step (server, uploads, key[, constants]) -> (server, metrics) in the federation `spec`;
  uploads, one `Uploads` per group, reach the method as `RoundUploads` (with its reductions over the
  participants); the algorithm's constants, where it has any, as a fourth argument."""
  step = phase.server_update(spec) if phase.server_of_spec else phase.server_update
  return lambda server, uploads, key, *constants: step(server, RoundUploads(uploads), key, *constants)


class UploadPrivacy(NamedTuple):
  """What of a method's upload carries its client's data, for client-level differential privacy
  (`fedjax_het.privacy.dp`, which clips and noises it); the default treats every floating part as data, read
  one upload at a time by the server, which is safe for any method.

  public: top-level parts of the upload that pass unclipped and un-noised: bookkeeping that carries no data, or
    what the method's docs state to leak (FedProto's per-class counts, which say which classes a client holds).
  reference(broadcast) -> {part: values}: for parts that are a model the client received and trained, what the
    contribution is measured from (its model delta is clipped, as in DP-FedAvg); None: the upload itself.
  holds(upload) -> {part: bool array broadcastable to the part}: the entries a client contributes to (the classes
    it holds; a server that averages each class over its holders); None: every entry.
  aggregate: how the server reads the private parts: 'records', each participant's upload on its own (FedRE trains
    its head on them); 'sum', only through unweighted means over the participants of all groups that hold an
    entry (FedProto); 'group_sum', the same within each group (grouped FedAvg). Central DP adds its noise once to
    each such sum; to each record for 'records'.
  hides_participants: whether what the server releases hides who took part in a round (its step reads a fixed
    number of noised records, or means over all participants, so that nothing it broadcasts depends on which
    clients were drawn beyond their noised contributions); only then may central accounting count on the random
    draw (amplification by sampling). False (safe): every round a client joins counts in full, because a per-group
    or per-class mean reveals its holders (a model unchanged when its group had nobody, a class present only when
    its one holder was drawn).
  """
  public: tuple[str, ...] = ()
  reference: Optional[Callable[[Any], dict]] = None
  holds: Optional[Callable[[Any], dict]] = None
  aggregate: str = 'records'
  hides_participants: bool = False


class Capabilities(NamedTuple):
  """What settings a method's programs and server can run with; the engine refuses the others.

  partial_batches: whether its programs weight losses and BatchNorm statistics by `Batch.mask`, so that it can run
    a schedule that keeps the last partial batch (--nodrop_last).
  shares_representations: whether anything of the representation width d crosses between architecture groups
    (prototypes, a shared head, representations); methods that exchange only whole models within groups, or
    generators, set False and may then run groups of different widths (--rm=none).
  server_model_evaluation: whether its evaluation scores a client with the model the server holds and broadcasts
    (the client's parameters replaced by it: grouped FedAvg), so that the server can score that model itself on
    rows it holds (the Flower server's 'server_accuracy', which no node's reply reaches); a model's BatchNorm
    statistics stay the client's unless the broadcast carries them."""
  partial_batches: bool = False
  shares_representations: bool = True
  server_model_evaluation: bool = False


def no_client_state(group: GroupSpec, key: jax.Array) -> Any:
  """init_client of methods without per-client algorithm state."""
  return {}


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """A federated method as pure functions.

  init_server(key, spec, initial) -> server state; `initial[g]` is group g's initial client state (its
    architecture's shared initialisation, which the server of HtFLlib builds from the same seed).
  init_client(group, key) -> the per-client algorithm state (`ClientState.extra`) of one client of the group.
  phases: the run's phases in order (most methods have one, of all rounds).
  evaluation(group) -> the `Evaluation` of that group's clients.
  samples(server, spec, key, n) -> images [C, n, H, W, channels] in [-1, 1]: n samples per class from the
    method's generator as the server holds it, for pictures (samples.png); None for methods without one.
  capabilities: what settings its programs and server can run with (`Capabilities`).
  upload_privacy: which parts of its uploads carry its clients' data and how its server reads them
    (`UploadPrivacy`), for the DP layer.
  constants: None, or a pytree of arrays that programs and server steps read and no round changes (FedMD's and
    FedDF's public images): the engine keeps them on device once and passes them to every jitted function as an
    argument (an array a function closes over would be compiled into it as a constant): to each server step as its
    fourth argument, server_update(server, uploads, key, constants), and to programs through each phase's
    `Phase.with_constants`; never stored, checkpointed or counted as traffic.
  """
  name: str
  init_server: Callable[[jax.Array, FederationSpec, Sequence[ClientState]], ServerState]
  phases: tuple[Phase, ...]
  evaluation: Callable[[GroupSpec], Evaluation]
  init_client: Callable[[GroupSpec, jax.Array], Any] = no_client_state
  samples: Optional[Callable[[ServerState, FederationSpec, jax.Array, int], jnp.ndarray]] = None
  capabilities: Capabilities = Capabilities()
  upload_privacy: UploadPrivacy = UploadPrivacy()
  constants: Any = None


def one_phase(name: str, init_server, client, server_update, evaluation, broadcast=whole_server,
              traffic: Traffic = Traffic(), **fields) -> Algorithm:
  """An `Algorithm` of a single phase running every round (most methods)."""
  return Algorithm(name, init_server, (Phase(name, client, server_update, broadcast, traffic=traffic),), evaluation,
                   **fields)


def hyperparameter(default: Any, help: str, flag: Optional[str] = None) -> Any:
  """A field of a method's config dataclass: its default, its help text and its command-line flag (default: the
  field's name; methods may share a flag whose meaning they share, e.g. --lamda)."""
  metadata = {'help': help} if flag is None else {'help': help, 'flag': flag}
  return dataclasses.field(default=default, metadata=metadata)
