"""Building blocks of methods: a loss turned into a `ClientProgram` (`sgd_program`), evaluation by heads on the
client's representations, and the one-liners simple methods share. The API itself is in `fedjax_het.core`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import (Algorithm, Batch, Broadcast, ClientProgram, ClientRows, ClientState, Evaluation,
                             FederationSpec, GroupSpec, Phase, Upload, Uploads, leaf_scalars, one_phase, parts, single_stage,
                             with_parts)
from fedjax_het.local_training import LocalTraining
from fedjax_het.methods.shared.common import head_apply
from fedjax_het.models.classifier import HeteroClassifier
from fedjax_het.models.forward import forward
from fedjax_het.models.shapes import variable_shapes

__all__ = ['Algorithm', 'Batch', 'ClientProgram', 'ClientRows', 'ClientState', 'Evaluation', 'FederationSpec',
           'GroupSpec', 'Phase', 'Uploads', 'leaf_scalars', 'one_phase', 'sgd_program', 'head_evaluation',
           'local_head_evaluation', 'trainable', 'with_trainable', 'no_upload', 'no_server', 'keep_server',
           'receive_head', 'initial_head', 'zero_params', 'HeadServer', 'HeadUpload', 'KeptOptimizer']

Loss = Callable[[ClientState, Batch, Broadcast, jax.Array], tuple[jnp.ndarray, Any]]


def trainable(client: ClientState) -> tuple[Any, Any]:
  """What a client's optimizer trains: (its classifier's params, the params of its extra modules, held under
  client.extra.params ({} when it has none: `methods.shared.global_model.Companion`))."""
  return client.params, parts(client.extra).get('params', {})


def with_trainable(client: ClientState, values: tuple[Any, Any]) -> ClientState:
  """The client with its `trainable` parts replaced."""
  params, extra = values
  if 'params' in parts(client.extra):
    return client._replace(params=params, extra=with_parts(client.extra, {'params': extra}))
  return client._replace(params=params)


def sgd_program(loss: Loss, training: LocalTraining, *, receive: Optional[Callable] = None,
                upload: Optional[Callable] = None, optimizer: Optional[optax.GradientTransformation] = None,
                representations: bool = False, statistics: Optional[Callable[[ClientState], Any]] = None,
                representation_weights: Optional[Callable] = None) -> ClientProgram:
  """The `ClientProgram` of a method whose clients minimise one loss with one optimizer (fresh every round, as
  HtFLlib builds its optimizers per round).

  loss(client, batch, broadcast, key) -> (loss, aux): the client carries the current `trainable` values; aux is
    the client with its non-trainable state updated (BatchNorm statistics), or, with `statistics`, (that client,
    this batch's statistics, a pytree of sums that the program adds up over the real steps; HtFLlib's FedProto
    and FD gather their prototypes and logits in the training passes).
  receive(client, broadcast) -> client: applied before training (e.g. set the head to the global head).
  upload(client, rows, broadcast, key) -> upload (default: nothing); rows.statistics holds the summed statistics.
  optimizer: default optax.sgd(training.learning_rate), plain SGD as HtFLlib; per-part rates with
    optax.multi_transform over `trainable`'s (params, extra params); or a function of the broadcast that builds it
    (a rate the server sets each round: HeteroFL's MultiStepLR).
  representations: upload reads rows.reps, the trained model's eval-mode representations of the training rows.
  representation_weights(client, rows, broadcast, key) -> W [rows, K]: upload reads rows.reps as the weighted
    sums W^T R [K, d] only (`ClientProgram.representation_weights`; the client is the trained one).
  statistics(client) -> zero sums shaped like those `loss` returns.
  """
  fixed = optimizer or optax.sgd(training.learning_rate)
  optimizer_of = fixed if callable(fixed) else (lambda broadcast: fixed)

  def init(client, broadcast, key):
    if receive is not None:
      client = receive(client, broadcast)
    sums = statistics(client) if statistics is not None else None
    return client, optimizer_of(broadcast).init(trainable(client)), sums

  def step(carry, batch, broadcast, key):
    client, opt_state, sums = carry
    values = trainable(client)
    objective = lambda v: loss(with_trainable(client, v), batch, broadcast, key)
    (value, aux), grads = jax.value_and_grad(objective, has_aux=True)(values)
    updated, batch_sums = aux if statistics is not None else (aux, None)
    updates, opt_state = optimizer_of(broadcast).update(grads, opt_state, values)
    client = with_trainable(updated, optax.apply_updates(values, updates))
    if statistics is not None:
      sums = jax.tree.map(jnp.add, sums, batch_sums)
    return (client, opt_state, sums), value

  def final(carry, rows, broadcast, key):
    client, _, sums = carry
    if upload is None:
      return client, {}
    return client, upload(client, rows._replace(statistics=sums), broadcast, key)

  weights = None
  if representation_weights is not None:
    weights = lambda carry, rows, broadcast, key: representation_weights(carry[0], rows, broadcast, key)
  return ClientProgram(init, single_stage(step, training), final, training,
                       (lambda carry: carry[0]) if representations or weights else None,
                       representation_weights=weights)


class KeptOptimizer(NamedTuple):
  """The per-client state (`ClientState.extra`) of a method whose clients keep their optimizer's state across
  rounds (FedMD's, FedGKT's and Felo's Adam): the state of an optimizer over the classifier's params."""
  optimizer: Any


def kept_optimizer_step(optimizer: optax.GradientTransformation, loss):
  """A local step on `loss(client, batch, broadcast) -> (value, client with new BatchNorm statistics)` with the
  client's own optimizer state kept across rounds (`KeptOptimizer`: FedMD's and FedGKT's Adam)."""
  def step(client: ClientState, batch, broadcast, key):
    objective = lambda params: loss(client._replace(params=params), batch, broadcast)
    (value, updated), grads = jax.value_and_grad(objective, has_aux=True)(client.params)
    updates, opt_state = optimizer.update(grads, client.extra.optimizer, client.params)
    return updated._replace(params=optax.apply_updates(client.params, updates),
                            extra=KeptOptimizer(opt_state)), value
  return step


def head_evaluation(model: HeteroClassifier, heads: dict[str, Callable[[ClientState, Broadcast], dict]],
                    receive: Optional[Callable] = None) -> Evaluation:
  """Scores the client's eval-mode representations with each named head (heads[name](client, broadcast) -> head
  params), in the dict's order (the first is the reported accuracy); `receive` first turns the client into the
  one evaluated (e.g. FedAvg's clients are scored with their group's global model)."""
  def prepare(client, broadcast):
    if receive is not None:
      client = receive(client, broadcast)
    return client.params, client.model_state, tuple(h(client, broadcast) for h in heads.values())

  def logits(evaluated, x):
    params, model_state, hs = evaluated
    _, reps, _ = forward(model, params, model_state, x, False)
    return tuple(head_apply(h, reps) for h in hs)
  return Evaluation(tuple(heads), prepare, logits)


class HeadServer(NamedTuple):
  """The server state, and broadcast, of a method whose server keeps one global head (FedRE's omega, LG-FedAvg's
  averaged head, FedGH's head trained on prototypes): its params {'kernel' [d, C], 'bias' [C]}."""
  head: dict


class HeadUpload(NamedTuple):
  """A client's trained head (LG-FedAvg, FedGen)."""
  head: dict


def own_head(client: ClientState, broadcast: Broadcast) -> dict:
  """The client's own head."""
  return client.params['head']


def global_head(client: ClientState, broadcast: Broadcast) -> dict:
  """The broadcast global head."""
  return broadcast.head


def local_head_evaluation(group: GroupSpec) -> Evaluation:
  """Each client scored with its own model."""
  return head_evaluation(group.model, {'local_head': own_head})


def global_head_evaluation(group: GroupSpec) -> Evaluation:
  """Reported: own extractor + the broadcast global head; also logged: the locally trained head."""
  return head_evaluation(group.model, {'global_head': global_head, 'local_head': own_head})


def receive_head(client: ClientState, broadcast: Broadcast) -> ClientState:
  """The client's head set to the broadcast global head (FedRE Alg. 1 line 6, LG-FedAvg, FedGH, FedGen)."""
  return client._replace(params={**client.params, 'head': broadcast.head})


def initial_head(key: jax.Array, spec: FederationSpec, initial) -> HeadServer:
  """init_server of global-head methods: the first group's initial head (HtFLlib builds it from the same seed)."""
  return HeadServer(initial[0].params['head'])


def zero_params(group: GroupSpec) -> Any:
  """Zero parameters shaped like the group's classifier's (the shapes of an optimizer state a client keeps)."""
  shapes = variable_shapes(group.model, group.input_shape)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes['params'])


def no_upload(client, rows, broadcast, key) -> Upload:
  """An upload of nothing."""
  return {}


def no_server(key: jax.Array, spec: FederationSpec, initial) -> Any:
  """Server state of methods without a server model."""
  return {}


def keep_server(server, uploads, key):
  """A server_update that changes nothing."""
  return server, {}


