"""Architecture groups: the clients that share an architecture, their data, and their initial stacked states."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fedjax_het.core import Algorithm, ClientState, GroupSpec, ModelMaker
from fedjax_het.data.federated import ClientArrays, FederatedData
from fedjax_het.engine.sharding import place_clients, to_device, to_host
from fedjax_het.engine.stores import RowStore
from fedjax_het.errors import ConfigError
from fedjax_het.local_training import LocalTraining
from fedjax_het.models.classifier import PRECISIONS
from fedjax_het.models.conv import EVAL_PASS_CONV
from fedjax_het.models.init import INITS, architecture_key, init_variables, init_with_output
from fedjax_het.models.registry import assign_models, build_model
from fedjax_het.models.shapes import cached_when_hashable, variable_shapes


MAX_FEATURE_DIM = 65536  # wider representations are a typo: their layers alone would not fit in memory


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The clients' classifiers.

  names: registered architectures (models/registry.py); client k gets names[k % len(names)].
  feature_dim: the representation width d after the RM step. rm: the RM step, 'ap' / 'mp' (adaptive pooling),
    'fc' (a learned Linear) or 'none' (the extractor's own features, of each architecture's width).
  init: 'torch' (PyTorch's default Conv/Linear initialisation, as HtFLlib) or 'flax' (Flax's defaults).
  shared_init: every client of an architecture starts from the same parameters (HtFLlib); otherwise each draws
    its own.
  precision: 'float32', or 'bfloat16': the classifiers compute in bfloat16 from float32 parameters
    (`models.forward`; the parameters, optimizer states and uploads stay float32).
  """
  names: tuple[str, ...]
  feature_dim: int = 512
  rm: str = 'ap'
  init: str = 'torch'
  shared_init: bool = True
  precision: str = 'float32'

  def __post_init__(self):
    object.__setattr__(self, 'names', tuple(self.names))
    if self.init not in INITS:
      raise ConfigError(f'ModelConfig.init={self.init!r} is unknown; choose one of {", ".join(INITS)} (torch: PyTorch\'s '
                        f'default Conv/Linear initialisation, as HtFLlib; flax: Flax\'s defaults).')
    if not 1 <= self.feature_dim <= MAX_FEATURE_DIM:
      raise ConfigError(f'ModelConfig.feature_dim={self.feature_dim} must be between 1 and {MAX_FEATURE_DIM} (the '
                        f'representation width d; ResNet-50\'s is 2048). Fix: a width in that range.')
    if self.precision not in PRECISIONS:
      raise ConfigError(f'ModelConfig.precision={self.precision!r} is unknown; choose one of {", ".join(PRECISIONS)}.')
    self.architectures(1)  # an empty or unknown name fails here

  def architectures(self, num_clients: int) -> list[str]:
    """Client k's architecture for k < num_clients: names[k % len(names)], a family expanded first."""
    return assign_models(self.names, num_clients)


@dataclasses.dataclass(frozen=True)
class ClassifierMaker:
  """The run's `core.ModelMaker`: registered architectures with its classes, RM and convolutions; modules
  initialised with its --init scheme; shared keys from its seed; repeated blocks scanned where `scan_blocks`."""
  num_classes: int
  rm: str
  conv: str
  init_scheme: str
  seed: int
  precision: str = 'float32'
  scan_blocks: bool = False

  def build(self, arch: str, feature_dim: int):
    return build_model(arch, self.num_classes, feature_dim, self.rm, self.conv, self.precision, self.scan_blocks)

  def init(self, module, key, *inputs, path: tuple = ()) -> dict:
    return init_variables(module, key, *inputs, scheme=self.init_scheme, path=path)

  def init_with_output(self, module, key, *inputs, path: tuple = ()) -> tuple[Any, dict]:
    return init_with_output(module, key, *inputs, scheme=self.init_scheme, path=path)

  def shared_key(self, name: str) -> jax.Array:
    return architecture_key(jax.random.PRNGKey(self.seed), name)


def representation_model(spec: GroupSpec):
  """The group's classifier for eval-mode representation passes: its own, except that an 'auto' run computes them
  with `models.conv.EVAL_PASS_CONV`'s formulation (the same parameters and values up to rounding)."""
  eval_conv = EVAL_PASS_CONV.get(spec.conv)
  if eval_conv is None or not isinstance(spec.maker, ClassifierMaker):
    return spec.model
  return dataclasses.replace(spec.maker, conv=eval_conv).build(spec.arch, spec.feature_dim)


class EvalSet:
  """Test rows: per client (client i scored on its own rows) or one set shared by every client, flat and compact
  (`rows`, a `stores.RowStore`); `arrays` is their padded copy on device ([G, n_max, ...], client i's rows in
  block i), made on first use, for the executors that read padded arrays."""

  def __init__(self, rows: RowStore, shared: bool, mesh=None, stacked_size: int = 0):
    self.rows, self.shared, self.mesh = rows, shared, mesh
    self.stacked_size = stacked_size or len(rows.n)
    self.sizes = rows.n  # host copy: loops are planned without device reads

  @functools.cached_property
  def arrays(self) -> ClientArrays:
    if self.shared:
      return jax.device_put(self.rows.padded())
    return place_clients(self.rows.padded(self.stacked_size), self.mesh)

  def index(self, i: int) -> int:
    """Which row block client i is scored on."""
    return 0 if self.shared else i


class Group:
  """Clients sharing one architecture, with their data.

  `rows`: the clients' training rows, flat and compact (`stores.RowStore`), which the vmap executor reads;
  `train`: the same rows padded to the largest client on device ([stacked_size, n_max, ...]), made on first use,
  which the sequential executor reads. The stacked client states have `stacked_size` >= size entries: those past
  `size` are phantom copies of the last client that only pad the client axis to a multiple of the device count.
  """

  def __init__(self, spec: GroupSpec, rows: RowStore, test: EvalSet, stacked_size: int, mesh=None,
               variables: Any = None):
    self.spec, self.rows, self.test, self.stacked_size, self.mesh = spec, rows, test, stacked_size, mesh
    self.clients = np.asarray(self.spec.clients)
    self.train_sizes = np.asarray(rows.n)[:len(self.clients)]
    self.stacked_ids = to_device(pad_clients(self.clients, self.stacked_size))
    if variables is None:  # the shapes of its classifier's variables, traced here unless the caller has them
      variables = variable_shapes(spec.model, spec.input_shape)
    self.num_params = count_params(variables['params'])

  @functools.cached_property
  def train(self) -> ClientArrays:
    return place_clients(self.rows.padded(self.stacked_size), self.mesh)

  @property
  def arch(self) -> str:
    return self.spec.arch

  @property
  def model(self):
    return self.spec.model

  @property
  def size(self) -> int:
    return len(self.clients)


def count_params(tree: Any) -> int:
  """Scalars in a pytree."""
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))


def pad_clients(tree: Any, size: int) -> Any:
  """Pads the leading (client) axis of host arrays to `size` with copies of the last client."""
  return jax.tree.map(lambda a: np.concatenate([a, np.repeat(a[-1:], size - a.shape[0], 0)]), tree)


def build_groups(data: FederatedData, models: ModelConfig, training: LocalTraining, conv: str, num_devices: int,
                 mesh, seed: int = 0, single_client_conv: Optional[str] = None, scan_blocks: bool = False
                 ) -> list[Group]:
  """One `Group` per architecture of the model family (client k gets models.names[k % len(names)]), in order of
  first appearance, each padded to a multiple of `num_devices` clients and placed on `mesh` (None: one device); a
  group stacked as one client builds its model with `single_client_conv` (None: `conv`); `scan_blocks`:
  `ExecutionConfig.scan_blocks`."""
  architectures = models.architectures(data.num_clients)
  feature_dim, rm = models.feature_dim, models.rm
  groups = []
  for index, arch in enumerate(dict.fromkeys(architectures)):
    ids = np.array([k for k, a in enumerate(architectures) if a == arch])
    stacked = -(-len(ids) // num_devices) * num_devices
    group_conv = single_client_conv if stacked == 1 and single_client_conv else conv
    maker = ClassifierMaker(data.num_classes, rm, group_conv, models.init, seed, models.precision, scan_blocks)
    rows = RowStore(data.group_rows(ids, 'train'))
    spec = GroupSpec(index, arch, maker.build(arch, feature_dim), tuple(int(k) for k in ids), data.num_classes,
                     feature_dim, rows.image_shape, training, maker, rm, group_conv, train_rows=rows.n_max)
    (_, reps), variables = check_architecture(spec)
    if rm == 'none':  # d is the architecture's own feature width
      width = int(reps.shape[-1])
      spec = dataclasses.replace(spec, model=maker.build(arch, width), feature_dim=width)
      variables = None
    test = EvalSet(RowStore(data.group_rows(ids, 'test')), shared=False, mesh=mesh, stacked_size=stacked)
    groups.append(Group(spec, rows, test, stacked, mesh, variables))
  models_of_groups = tuple(g.spec.model for g in groups)
  for g in groups:
    g.spec = dataclasses.replace(g.spec, group_models=models_of_groups)
  return groups


def check_architecture(spec: GroupSpec) -> Any:
  """Traces the group's classifier initialiser (`classifier_initializers`) abstractly, so an architecture that
  cannot take the data's images fails here, with the flag named, instead of deep inside XLA. Returns its shapes:
  ((logits, representations) of one image, variables). The trace is the one the initialiser's call then reuses
  (`init_group`): a deep model's forward pass is traced once to check it and initialise it."""
  initializers = classifier_initializers(spec.maker, spec.model, tuple(spec.input_shape))
  key = jax.eval_shape(lambda: spec.maker.shared_key(spec.arch))  # its shape: the check compiles nothing
  params, others = shapes(lambda: initializers.one.eval_shape(key),
                          f'ModelConfig.names: architecture {spec.arch!r}', 'ModelConfig.names', spec.input_shape)
  return initializers.output_shapes, {'params': params, **others}


def shapes(trace: Callable[[], Any], what: str, flag: str, image_shape) -> Any:
  """trace() (an abstract trace's shapes), any failure but a ConfigError turned into one naming `what` and `flag`."""
  try:
    return trace()
  except ConfigError:
    raise
  except Exception as e:  # Flax/XLA raise many types for impossible shapes (ZeroDivisionError, TypeError, ...).
    raise ConfigError(f'{what} cannot take images of shape {tuple(image_shape)} '
                      f'({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}). Fix: choose, with '
                      f'{flag}, models for this image size (e.g. small_cnn or mlp for 8x8 digits; cnn4 and resnet* '
                      f'for 32x32).') from e


@dataclasses.dataclass(frozen=True)
class ClassifierInitializers:
  """A classifier's jitted initialisers, as (params, the other collections): `one` from one key, `each` from a
  vector of keys (one client each). `output_shapes`: the (logits, representations) shapes of the image the
  initialiser is traced on, recorded by its first trace (a dict, empty until then)."""
  one: Callable
  each: Callable
  traced: dict

  @property
  def output_shapes(self) -> Any:
    return self.traced['outputs']


@cached_when_hashable(maxsize=64)
def classifier_initializers(maker: ModelMaker, model: Any, input_shape: tuple) -> ClassifierInitializers:
  """Jitted initialisers of a classifier's variables (`ClassifierInitializers`). Made once per (maker, model, image
  shape) in a process (afresh for an unhashable maker or module), so that every federation of the same
  architectures and run settings after the first (a notebook or a sweep building the run again) reuses their
  traces: an initialiser is the dearest program of a small federation to trace and lower (a random draw per
  parameter). The outputs are not the program's (XLA would compile the forward pass for them): only their shapes
  are kept, as a trace's side record."""
  traced: dict = {}

  def init_classifier(k):
    outputs, variables = maker.init_with_output(model, k, jnp.zeros((1,) + input_shape))
    traced['outputs'] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), outputs)
    params = variables.pop('params')
    return params, variables
  return ClassifierInitializers(jax.jit(init_classifier), jax.jit(jax.vmap(init_classifier)), traced)


def init_group(algorithm: Algorithm, g: Group, init_key: jax.Array, key_key: jax.Array, shared_init: bool,
               mesh) -> ClientState:
  """The group's stacked initial client states: classifier variables (--init's scheme), the algorithm's
  per-client state from the same key, and each client's fixed key.

  With `shared_init` (HtFLlib) every client of an architecture starts from the same parameters, drawn from a key
  of the seed and the architecture's name; otherwise each client draws its own."""
  spec = g.spec
  initializers = classifier_initializers(spec.maker, spec.model, tuple(spec.input_shape))
  # The classifier's initialiser was traced by `check_architecture`; only the algorithm's own state is left. Its
  # shapes come from the jitted initialiser itself, whose call then reuses that trace.
  check = lambda init, keys: shapes(lambda: init.eval_shape(keys),
                                    'the algorithm\'s client modules (e.g. a shared global model)',
                                    'the method\'s hyperparameters (e.g. its global model)', spec.input_shape)
  if shared_init:
    group_key = architecture_key(init_key, spec.arch)
    init_client = jax.jit(lambda k: algorithm.init_client(spec, k))
    extra_shape = check(init_client, group_key)
    # One client's state, computed once and broadcast: the programs do not depend on the number of clients, so a
    # larger population compiles nothing new (XLA's persistent compilation cache, `compilation_cache`).
    params, variables = broadcast_clients(initializers.one(group_key), g.stacked_size)
    init_extra = lambda: broadcast_clients(init_client(group_key), g.stacked_size)
  else:
    init_keys = fold_in_each(init_key, g.stacked_ids)
    init_clients = jax.jit(jax.vmap(lambda k: algorithm.init_client(spec, k)))
    extra_shape = check(init_clients, init_keys)
    # Two programs, not one: the algorithm's state is often the same program in every group (a generator, an
    # optimizer), which XLA's persistent compilation cache (`compilation_cache`) then compiles once per run.
    params, variables = initializers.each(init_keys)
    init_extra = lambda: init_clients(init_keys)
  # A method without client state (most): its empty structure, no program.
  extra = init_extra() if jax.tree.leaves(extra_shape) else extra_shape
  keys = fold_in_each(key_key, g.stacked_ids)
  return place_clients(ClientState(params, dict(variables), extra, keys), mesh)


@jax.jit
def fold_in_each(key: jax.Array, client_ids: jnp.ndarray) -> jax.Array:
  """fold_in(key, c) for each client id c, in one program (eagerly, a program per operation)."""
  return jax.vmap(lambda c: jax.random.fold_in(key, c))(client_ids)


@functools.partial(jax.jit, static_argnums=1)
def broadcast_clients(tree: Any, size: int) -> Any:
  """Every leaf of `tree` repeated `size` times along a new leading (client) axis."""
  return jax.tree.map(lambda a: jnp.broadcast_to(a, (size,) + a.shape), tree)


@jax.jit
def stack_slots(uploads: list, losses: list) -> tuple[Any, jnp.ndarray]:
  """The slots' uploads stacked leaf by leaf along a new leading axis, and their losses as a float32 vector: one
  program per upload structure and slot count (stacked leaf by leaf outside jit, one per leaf shape)."""
  return jax.tree.map(lambda *a: jnp.stack(a), *uploads), jnp.stack([jnp.asarray(l, jnp.float32) for l in losses])


def take_client(tree: Any, index) -> Any:
  """Entry `index` of the leading (client) axis of every leaf of a stacked tree (lax's dynamic index: numpy-style
  indexing traces a hundred times slower, seconds for a ResNet-152's state)."""
  return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False), tree)


def put_client(tree: Any, index, client: Any) -> Any:
  """The stacked tree with entry `index` of every leaf's client axis replaced by `client`'s leaf."""
  return jax.tree.map(lambda a, v: lax.dynamic_update_index_in_dim(a, v, index, 0), tree, client)


# Client i of every leaf in one program per state structure (indexing leaf by leaf compiles one per leaf shape:
# hundreds for a ResNet-152, most of a cold start's compilations).
take_client_jit = jax.jit(take_client)


def host_copy(tree: Any, index: int = 0) -> Any:
  """Client `index` of a stacked state as plain (unsharded, uncommitted) arrays. `jax.device_put` moves the host
  copies back without compiling anything (`jnp.asarray` of a NumPy array compiles one program per leaf shape)."""
  return jax.device_put(jax.tree.map(to_host, take_client_jit(tree, np.int32(index))))


def slot_indices(g: Group, participants: np.ndarray, slots: int) -> np.ndarray:
  """The group's participant slots of a round: local indices of its participants, then `stacked_size` (past the
  stack: empty) up to `slots`."""
  local = np.flatnonzero(np.isin(g.clients, participants))
  idx = np.full(slots, g.stacked_size, np.int32)
  idx[:len(local)] = local
  return idx


def clients_without_steps(groups: Sequence[Group], batch_size: int) -> list[int]:
  """Ascending ids of the clients with fewer training rows than one batch: they take no local step, since an
  epoch drops the last partial batch (HtFLlib's drop_last)."""
  return sorted(int(k) for g in groups for k, n in zip(g.clients, g.train_sizes) if n < batch_size)
