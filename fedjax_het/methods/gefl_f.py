"""GeFL-F ("GeFL: Model-Agnostic Federated Learning with Generative Models", Alg. 3, Sec. VI): GeFL on the features of
a shared extractor.

Each target network is GeFL's CNN-k split into a common feature extractor F (its first block: conv 3x3 to 3
channels, BatchNorm, ReLU, max pool: 3x16x16 maps from 32x32 images; `models.gefl_cnn.GeFLCNN` stage 'features')
and a header (the rest, RM and head).
Phase 'warmup' (T_FE = --gefl_fe_rounds rounds): full-model training on real data for --gefl_warmup_epochs (T_w)
  epochs of plain SGD; the server averages F over all participants of all groups and each header within its group
  (equal weights, BatchNorm statistics included).
Phase 'knowledge' (T_KA rounds, not evaluated): F frozen in eval mode; each participant trains the feature
  generator (DCGAN-F, CVAE-F or DDPM-F on 16x16x3 maps, `fedjax_het.generators`) on (F(x), y) with its own
  optimizer state; the server averages it over all participants.
Phase 'target' (T_TN = --rounds rounds): headers only: T_s epochs on generated feature maps (uniform labels), then
  T_r = --local_epochs epochs on F(x) of real rows (F in eval mode, frozen); headers averaged within groups; F never
  changes again.
  "Update" mode (--gefl_mode=update; GeFL's Sec. V-B mode, which the paper runs for GeFL only): T_KA / 2 knowledge
  rounds, then after its header training each participant also trains the feature generator T_g epochs on F's maps
  of its real rows (its own optimizer state) and the server averages it over all participants, so target round t
  samples from the generator after T_KA / 2 + t - 1 rounds. "Freeze" (default, the paper's GeFL-F) keeps the
  generator as the last knowledge round left it.
Evaluation: F + the group's header on the test set; `best_accuracy_per_architecture_mean` covers the warm-up
evaluations too (the code's best-over-rounds does).

CIFAR-10 (Fig. 4): GeFL-F runs on `gefl-cifar10f-10`, the CIFAR-10 CNNs as GeFL's code builds them, whose common
block is conv(3 -> 3) BN ReLU maxpool (3x16x16 maps, the shape the code's -F generators emit); `gefl-cifar10-10`
follows Table XXIII's extra conv(10) row, which would make F emit 10x16x16 maps.
Not built: samples.png (the generator draws feature maps, not images). The MND ratio's synthetic images are
generated maps inverted through the frozen F (`fedjax_het.evaluation.mnd.gefl_f_synthetic_images`, experiments/mnd.py).

GeFL's LG-FedAvg baseline (`lg_fedavg_first_block`) is this module's warm-up phase for the whole run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_het.core import (Algorithm, Batch, Capabilities, ClientProgram, GroupSpec, Phase, Stage, Traffic,
                             hyperparameter, leaf_scalars, parts)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.generators.base import uniform_labels
from fedjax_het.methods.gefl import (GeFLConfig, average_generators, build_generator, ddpm_lr_scale, generator_step,
                                     init_generator_extra, knowledge_server, receive_generator, upload_generator)
from fedjax_het.methods.shared.base import head_evaluation, own_head
from fedjax_het.methods.shared.common import cross_entropy, descend
from fedjax_het.models.forward import forward
from fedjax_het.models.gefl_cnn import GeFLCNN, join_client, split_client
from fedjax_het.models.shapes import init_shapes

@dataclasses.dataclass(frozen=True)
class GeFLFConfig(GeFLConfig):
  """GeFL-F's hyperparameters: GeFL's, and the extractor warm-up (GeFL paper, Sec. VI, Tables XIV-XV)."""
  fe_rounds: int = hyperparameter(20, 'GeFL-F: warm-up rounds T_FE of the shared feature extractor (20 MNIST/FMNIST, '
                                      '50 SVHN/CIFAR-10).', flag='gefl_fe_rounds')
  warmup_epochs: int = hyperparameter(5, 'GeFL-F: local epochs T_w of a warm-up round.', flag='gefl_warmup_epochs')

  def __post_init__(self):
    super().__post_init__()
    if self.fe_rounds < 0 or self.warmup_epochs < 0:
      raise ConfigError(f'{setting(self, "fe_rounds")} and {setting(self, "warmup_epochs")} must be '
                        f'>= 0.')


def extractor_of(group: GroupSpec, stage: str):
  """The group's GeFL CNN at `stage` ('features': F; 'header': the classifier from F's maps), or a ConfigError."""
  extractor = group.model.extractor
  if not isinstance(extractor, GeFLCNN) or extractor.dataset == 'cifar10':
    raise ConfigError(f'GeFL-F splits GeFL\'s CNNs into a shared 3-channel extractor and a header; {group.arch!r} is '
                      f'not one (Table XXIII\'s CIFAR-10 CNNs add a conv(10) to the common block). Fix: '
                      f'ModelConfig.names=gefl-mnist-10, gefl-fmnist-10 or gefl-cifar10f-10 (CIFAR-10 as GeFL\'s code '
                      f'builds it).')
  return extractor.clone(stage=stage, parent=None)


def features_module(group: GroupSpec) -> GeFLCNN:
  """F, the same module for every architecture (CNN-1's first block) so that its users compile once."""
  extractor = extractor_of(group, 'features')
  return GeFLCNN(extractor.dataset, 1, extractor.conv, stage='features')


def apply_features(module: GeFLCNN, fe: dict, x):
  """F(x) [B, 16, 16, 3] in eval mode with F's {'params', 'stats'}."""
  variables = {'params': fe['params'], **({'batch_stats': fe['stats']} if fe['stats'] else {})}
  return module.apply(variables, x, False)


def feature_map_shape(group: GroupSpec) -> tuple[int, ...]:
  """The shape of F's maps of one of the group's inputs."""
  module = features_module(group)
  return tuple(init_shapes(module, group.input_shape, train=False)[0].shape[1:])


def feature_generator(cfg: GeFLFConfig, num_classes: int, group: GroupSpec):
  """The configured generator of F's feature maps (DCGAN-F, CVAE-F, DDPM-F), at CIFAR-10's sizes for CIFAR-10's
  CNNs (Table XV)."""
  return build_generator(cfg, num_classes, feature_map_shape(group), group.conv, features=True,
                         cifar10_sizes=extractor_of(group, 'features').dataset == 'cifar10f')


class SharedBlock(NamedTuple):
  """The server of GeFL's LG-FedAvg baseline: fe, the shared first block F; headers, each group's header."""
  fe: dict
  headers: tuple


class GeFLFServer(NamedTuple):
  """GeFL-F's server: F and the headers (`SharedBlock`'s fields), the feature generator and its round count."""
  fe: dict
  headers: tuple
  generator: dict
  generator_round: jnp.ndarray


class GeFLFBroadcast(NamedTuple):
  """What a group's clients receive: F; the group's header (warm-up and target rounds); the generator and its round
  count (knowledge and target rounds); None where not sent."""
  fe: dict
  header: Any = None
  generator: Any = None
  generator_round: Any = None


class GeFLFUpload(NamedTuple):
  """A client's upload: F (warm-up), its header (warm-up and target), its generator (knowledge; target in update
  mode); None where not sent."""
  fe: Any = None
  header: Any = None
  generator: Any = None


def receive_model(client, broadcast):
  """The client's classifier set to the broadcast F and its group's header (unchanged without a header)."""
  if broadcast.header is None:
    return client
  params, model_state = join_client(broadcast.fe, broadcast.header, client.model_state)
  return client._replace(params=params, model_state=model_state)


def model_broadcast(server, group) -> GeFLFBroadcast:
  """F and the group's header."""
  return GeFLFBroadcast(server.fe, server.headers[group.index])


def average_headers(server, uploads):
  """Each group's header averaged over its participants with equal weights (kept without any)."""
  return uploads.group_mean('header', previous=server.headers)


def shared_block_server(key, spec, initial) -> SharedBlock:
  """F of the first group's initial model, and each group's initial header."""
  fe, _ = split_client(initial[0].params, initial[0].model_state)
  return SharedBlock(fe, tuple(split_client(s.params, s.model_state)[1] for s in initial))


def shared_block_program(group: GroupSpec, epochs: int) -> ClientProgram:
  """Full-model training with F shared: receive F and the group's header, `epochs` epochs of plain SGD on CE,
  upload F and the header (GeFL-F's warm-up; GeFL's LG-FedAvg baseline)."""
  optimizer = group.training.optimizer()

  def step(client, batch: Batch, broadcast, key):
    def loss(params):
      logits, _, state = forward(group.model, params, client.model_state, batch.x, True, batch.mask)
      return cross_entropy(logits, batch.y, batch.mask), state
    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    return client._replace(params=descend(optimizer, client.params, grads), model_state=state), value

  def final(client, rows, broadcast, key):
    return client, GeFLFUpload(*split_client(client.params, client.model_state))
  extractor_of(group, 'features')  # a ConfigError for architectures without F
  return ClientProgram(lambda client, broadcast, key: receive_model(client, broadcast), (Stage(step, epochs),),
                       final, group.training)


def shared_block_update(server, uploads, key):
  """F averaged over all participants of all groups, each header within its group (equal weights, BatchNorm
  statistics included)."""
  fe = uploads.mean('fe', previous=server.fe)  # headers differ by group
  return server._replace(fe=fe, headers=average_headers(server, uploads)), {}


def model_scalars(tree) -> dict:
  """F and the header where they cross (GeFL's LG-FedAvg baseline: every round, both ways)."""
  count = lambda t: sum(leaf_scalars(t).values())
  return {'extractor': count(tree.fe), 'header': count(tree.header)}


def lg_fedavg_first_block(num_classes: int) -> Algorithm:
  """GeFL's LG-FedAvg baseline (GeFL paper, Table II; its code's `avg_FE = 1`): GeFL's CNNs with the first
  convolution block F averaged over all clients and the rest of each model within its architecture, every round
  --local_epochs epochs of plain SGD (GeFL-F's warm-up phase for the whole run). The library's `lg_fedavg` is
  LG-FedAvg as HtFLlib runs it (local extractors, one shared head)."""
  return Algorithm('lg_fedavg_fb', shared_block_server,
                   (Phase('lg_fedavg_fb', lambda g: shared_block_program(g, g.training.epochs),
                          shared_block_update, model_broadcast, traffic=Traffic(model_scalars, model_scalars)),),
                   lambda group: head_evaluation(group.model, {'group_model': own_head}, receive=receive_model),
                   capabilities=Capabilities(partial_batches=True, shares_representations=False))


def extractor_features(module: GeFLCNN, fe: dict, x):
  """F(x) in eval mode with the broadcast F, a constant for the caller's gradients."""
  return jax.lax.stop_gradient(apply_features(module, fe, x))


def header_model(group: GroupSpec):
  """The group's classifier from F's maps (its header)."""
  return group.model.clone(extractor=extractor_of(group, 'header'), parent=None)


def init_server(key: jax.Array, spec, initial) -> GeFLFServer:
  """F and the headers of `shared_block_server`, the first client's generator and its round count."""
  return GeFLFServer(*shared_block_server(key, spec, initial), initial[0].extra.generator, jnp.zeros((), jnp.int32))


# ---------------------------------------------------------------- phase 'warmup'
def warmup_client(cfg: GeFLFConfig, group: GroupSpec) -> ClientProgram:
  """The whole classifier trained T_w epochs (`shared_block_program`)."""
  return shared_block_program(group, cfg.warmup_epochs)


# ---------------------------------------------------------------- phase 'knowledge'
def knowledge_client(cfg: GeFLFConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """The server's feature generator, trained T_g epochs on F's maps of the client's real batches with its own
  optimizer state. No header enters this program: it is the same for every group of one F, so executors compile
  it once."""
  module = features_module(group)
  gen = feature_generator(cfg, num_classes, group)
  step = generator_step(gen, ddpm_lr_scale(cfg), lambda x, broadcast: extractor_features(module, broadcast.fe, x))
  return ClientProgram(lambda client, broadcast, key: receive_generator(client, broadcast),
                       (Stage(step, cfg.generator_epochs),), upload_generator, group.training,
                       identity=('gefl_f.knowledge', module, feature_map_shape(group), group.conv,
                                 group.training))


def knowledge_broadcast(server: GeFLFServer, group) -> GeFLFBroadcast:
  """F, the generator and its round count."""
  return GeFLFBroadcast(server.fe, None, server.generator, server.generator_round)


# ---------------------------------------------------------------- phase 'target'
def target_client(cfg: GeFLFConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """F and the group's header; the header trained T_s epochs on generated maps, then T_r epochs on F's maps of
  real batches, F untouched; in update mode the generator then trains T_g epochs on F's maps. Uploads the header
  (and the generator)."""
  update = cfg.mode == 'update'
  gen, header, optimizer = feature_generator(cfg, num_classes, group), header_model(group), group.training.optimizer()
  module = features_module(group)

  def sgd_on_header(client, maps, y, mask):
    """One SGD step of the header (F's parameters untouched) on feature maps (the rows where mask is True)."""
    fe, head = split_client(client.params, client.model_state)

    def loss(head_params):
      params, model_state = join_client(fe, {'params': head_params, 'stats': head['stats']}, client.model_state)
      logits, _, state = forward(header, params, model_state, maps, True, mask)
      return cross_entropy(logits, y, mask), state
    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(head['params'])
    head_params = descend(optimizer, head['params'], grads)
    _, new_head = split_client(head_params, state)
    params, model_state = join_client(fe, {'params': head_params, 'stats': new_head['stats']}, client.model_state)
    return client._replace(params=params, model_state=model_state), value

  def synthetic_step(client, batch: Batch, broadcast, key):
    label_key, sample_key = jax.random.split(key)
    labels = uniform_labels(label_key, group.training.batch_size, num_classes)
    maps = jax.lax.stop_gradient(gen.sample(broadcast.generator, labels, sample_key))
    return sgd_on_header(client, maps, labels, batch.mask)

  def real_step(client, batch: Batch, broadcast, key):
    return sgd_on_header(client, extractor_features(module, broadcast.fe, batch.x), batch.y, batch.mask)

  def init(client, broadcast, key):
    client = receive_model(client, broadcast)
    return receive_generator(client, broadcast) if update else client

  def final(client, rows, broadcast, key):
    return client, GeFLFUpload(header=split_client(client.params, client.model_state)[1],
                               generator=client.extra.generator if update else None)

  stages = (Stage(synthetic_step, cfg.synthetic_epochs, generated=True), Stage(real_step, group.training.epochs))
  if update:
    learn_maps = lambda x, broadcast: extractor_features(module, broadcast.fe, x)
    stages += (Stage(generator_step(gen, ddpm_lr_scale(cfg), learn_maps), cfg.generator_epochs),)
  return ClientProgram(init, stages, final, group.training)


def target_server(cfg: GeFLFConfig, server: GeFLFServer, uploads, key: jax.Array) -> tuple[GeFLFServer, dict]:
  """Each group's header <- the mean of its participants' (`average_headers`); in update mode the generator
  <- the mean over all participants of all groups."""
  server = server._replace(headers=average_headers(server, uploads))
  return (average_generators(server, uploads) if cfg.mode == 'update' else server), {}


def target_broadcast(server: GeFLFServer, group) -> GeFLFBroadcast:
  """F, the group's header, the generator and its round count."""
  return model_broadcast(server, group)._replace(generator=server.generator, generator_round=server.generator_round)


def evaluation(group: GroupSpec):
  """Every client scored with F and its group's header."""
  return head_evaluation(group.model, {'group_model': own_head}, receive=receive_model)


def sent_scalars(cfg: GeFLFConfig, tree: dict) -> dict:
  """What crosses: F and the headers in warm-up rounds, the generator in knowledge rounds, the headers (and in
  update mode the generator) in target rounds. Later broadcasts carry F (and in freeze mode the generator) only for
  the engine: clients already hold them, except F's last average, which reaches them once at the start of
  knowledge aggregation (42 scalars at MNIST size with its BatchNorm statistics; not counted)."""
  count = lambda t: sum(leaf_scalars(t).values())
  sent = {k: v for k, v in parts(tree).items() if v is not None}  # a phase's broadcast or upload: what it holds
  out = {'header': count(sent['header'])} if 'header' in sent else {}
  if 'fe' in sent and 'generator' not in sent:
    out['extractor'] = count(sent['fe'])
  if 'generator' in sent and ('header' not in sent or cfg.mode == 'update'):
    out['generator'] = count(sent['generator'])
  return out


def gefl_f(cfg: GeFLFConfig, num_classes: int, rounds: int) -> Algorithm:
  """GeFL-F as an `Algorithm` of three phases: 'warmup' (T_FE), 'knowledge' (T_KA) and 'target' (`rounds`)."""
  scalars = functools.partial(sent_scalars, cfg)
  traffic = Traffic(scalars, scalars)
  phases = (Phase('warmup', functools.partial(warmup_client, cfg), shared_block_update, model_broadcast,
                  rounds=cfg.fe_rounds, traffic=traffic),
            Phase('knowledge', functools.partial(knowledge_client, cfg, num_classes), knowledge_server,
                  knowledge_broadcast, rounds=cfg.knowledge_rounds, evaluate=False, traffic=traffic),
            Phase('target', functools.partial(target_client, cfg, num_classes),
                  functools.partial(target_server, cfg), target_broadcast, rounds=rounds, traffic=traffic))
  return Algorithm('gefl_f', init_server, phases, evaluation,
                   init_client=functools.partial(init_generator_extra,
                                                 functools.partial(feature_generator, cfg, num_classes)),
                   capabilities=Capabilities(partial_batches=True, shares_representations=False))
