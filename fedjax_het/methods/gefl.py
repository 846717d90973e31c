"""GeFL ("GeFL: Model-Agnostic Federated Learning with Generative Models", Alg. 1-2, Sec. IV-V): one class-conditional
generator trained federatedly by every client whatever its architecture, and heterogeneous target networks trained on
its samples and on real data, averaged only within their architecture.

Phase 'knowledge' (T_KA = --gefl_ka_rounds rounds; T_KA / 2 in update mode; no evaluation): a participant sets
  its generator to the server's and trains it for T_g = --gefl_generator_epochs epochs on its real batches with
  its OWN optimizer state(s), kept in its `ClientState.extra` across rounds (the code's `optgs[idx]` etc.; DCGAN:
  G's and D's); it uploads the generator (every variable, BatchNorm statistics and, for DCGAN, D included), and the
  server takes the unweighted mean over all participants of all architecture groups.
Phase 'target' (T_TN = --rounds rounds): a participant sets its target network to its group's model, trains it
  T_s = --gefl_synthetic_epochs epochs of max(1, n_k // B) steps on generated batches (B labels uniform over all
  classes, not its own label mix; the server's generator in eval mode; target BatchNorm in train mode), then
  T_r = --local_epochs epochs on its real rows, plain SGD at --local_learning_rate (`LocalTraining.optimizer`,
  stateless); the server averages each group's uploads with equal weights (Alg. 2; BatchNorm statistics too).
  "Update" mode (--gefl_mode=update, Table VII): after its target training each participant also trains the
  generator T_g epochs (own optimizer state) and the server averages it, so target round t samples from the
  generator after T_KA / 2 + t - 1 rounds. "Freeze" (default): the generator stays as the last knowledge round
  left it.
Evaluation: every client is scored with its group's model; `summary.json` adds GeFL's reported number, the mean
over architectures of each architecture's best accuracy over the evaluation rounds
(best_accuracy_per_architecture_mean).

Generators (`fedjax_het.generators`): 'dcgan' (Adam 2e-4, betas 0.5 / 0.999), 'cvae' (Adam 1e-3, weight decay
1e-3), 'ddpm' (Adam 1e-4, decayed linearly: rate 1e-4 (1 - t / T_KA) in knowledge round t = 1..T_KA, as the
code). DCGAN trains on and emits [-1, 1]; CVAE and DDPM [0, 1] (the code feeds them ToTensor images). With
--gefl_match_range (default) their samples are mapped into the classifiers' input range [-1, 1]; --nogefl_match_range
feeds the generators' own range unconverted, the code's mismatch (a quirk of the code that the default does not copy).

Batches: GeFL's code loads real rows with PyTorch's default loader (shuffled, the last partial batch kept), for the
target networks and the generators alike: run with --data_order=shuffle --nodrop_last, as the paper flag files do
(a client of 60 rows and batch 64 then takes one step of 60 rows per epoch, where drop_last would take none). A
synthetic epoch is the code's floor(n_k / B) steps of B generated samples, one step of n_k samples when n_k < B
(576 samples per epoch for MNIST's 600 rows, not the 64 that Sec. V-D describes).
First block: the paper averages target networks model-wise within architectures (Alg. 2), the default here. The
paper-era code's default `avg_FE = 1` also averaged the CNNs' first block (conv, BatchNorm and its statistics) over
all clients, LG-FedAvg-like, and the commands of docs/methods/gefl.md do not override it, so Table II may include
that sharing: --gefl_share_first_block reproduces it (with one client per architecture, as in Table II, it is the
only averaging).
Communication: per knowledge round each participant downloads and uploads the generator (|G| + |D| for DCGAN);
per target round its group's model both ways (plus the generator in update mode).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from fedjax_het.core import (Algorithm, Batch, Capabilities, ClientProgram, GroupSpec, Phase, RoundUploads, Stage,
                             Traffic, hyperparameter, leaf_scalars)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.generators import (GENERATORS, ConditionalGenerator, cvae, dcgan, ddpm, from_generator_range,
                                   to_generator_range)
from fedjax_het.generators.base import uniform_labels
from fedjax_het.methods.shared.base import head_evaluation, own_head
from fedjax_het.methods.shared.common import cross_entropy, descend
from fedjax_het.models.forward import forward
from fedjax_het.models.gefl_cnn import join_client, split_client

MODES = ('freeze', 'update')


@dataclasses.dataclass(frozen=True)
class GeFLConfig:
  """GeFL's hyperparameters (GeFL paper, Tables XIV, XV). Widths 0 take the paper's size."""
  generator: str = hyperparameter('dcgan', "GeFL: the generator, one of 'dcgan', 'cvae', 'ddpm'.",
                                  flag='gefl_generator')
  ka_rounds: int = hyperparameter(100, 'GeFL: knowledge-aggregation rounds T_KA (Table XV: 100 MNIST/FMNIST/SVHN, '
                                       '200 CIFAR-10); update mode runs T_KA / 2 of them.', flag='gefl_ka_rounds')
  generator_epochs: int = hyperparameter(5, 'GeFL: local generator epochs T_g.', flag='gefl_generator_epochs')
  synthetic_epochs: int = hyperparameter(1, 'GeFL: target epochs on generated batches T_s (then --local_epochs on '
                                            'real rows).', flag='gefl_synthetic_epochs')
  mode: str = hyperparameter('freeze', "GeFL: 'freeze' (the generator stops after knowledge aggregation) or "
                                       "'update' (it keeps training in target rounds; Table VII).",
                             flag='gefl_mode')
  match_range: bool = hyperparameter(True, 'GeFL: map generated images into the classifiers\' input range [-1, 1] '
                                           '(false: the code\'s unconverted [0, 1] of CVAE and DDPM).',
                                     flag='gefl_match_range')
  width: int = hyperparameter(0, 'GeFL: generator width (DCGAN d_g = d_d, CVAE w, U-Net n_feat); 0: the paper\'s '
                                 '(DCGAN 128; CIFAR-10\'s 256 / 64 on 3-channel data, so SVHN wants 128; CVAE 64; '
                                 'U-Net 128).',
                              flag='gefl_width')
  latent: int = hyperparameter(0, 'GeFL: CVAE latent size l; 0: the paper\'s (16; CIFAR-10\'s 50 on 3-channel data, '
                                       'so SVHN wants 16).',
                               flag='gefl_latent')
  diffusion_steps: int = hyperparameter(100, 'GeFL: DDPM steps T (100 MNIST/FMNIST/SVHN, 400 CIFAR-10).',
                                        flag='gefl_diffusion_steps')
  guidance: float = hyperparameter(0.0, 'GeFL: DDPM classifier-free guidance weight w (Table II: 0 and 2).',
                                   flag='gefl_guidance')
  share_first_block: bool = hyperparameter(False, 'GeFL: in target rounds also average the CNNs\' first block (conv '
                                                  'and BatchNorm, F) over all participants of all architectures (the '
                                                  'code\'s default avg_FE = 1, LG-FedAvg-like); false: the paper\'s '
                                                  'model-wise averaging within architectures.',
                                           flag='gefl_share_first_block')

  def __post_init__(self):
    if self.generator not in GENERATORS:
      raise ConfigError(f'{setting(self, "generator")}: choose one of {", ".join(GENERATORS)}.')
    if self.mode not in MODES:
      raise ConfigError(f'{setting(self, "mode")}: choose freeze or update.')
    if self.ka_rounds < (2 if self.mode == 'update' else 1):
      raise ConfigError(f'{setting(self, "ka_rounds")} must be >= 1 (>= 2 in update mode, which runs half).')
    for name in ('generator_epochs', 'synthetic_epochs', 'width', 'latent'):
      if getattr(self, name) < 0:
        raise ConfigError(f'{setting(self, name)} must be >= 0.')
    if self.diffusion_steps < 1 or self.guidance < 0:
      raise ConfigError(f'{setting(self, "diffusion_steps")} must be >= 1 and '
                        f'{setting(self, "guidance")} >= 0.')

  @property
  def knowledge_rounds(self) -> int:
    """Rounds of the knowledge phase: T_KA, or T_KA / 2 in update mode."""
    return self.ka_rounds // 2 if self.mode == 'update' else self.ka_rounds


def build_generator(cfg: GeFLConfig, num_classes: int, input_shape, conv: str = 'xla', features: bool = False,
                    cifar10_sizes: Optional[bool] = None) -> ConditionalGenerator:
  """The configured generator for images of `input_shape` (H, W, c), or with `features` for GeFL-F's 16x16 feature
  maps (DCGAN-F, CVAE-F, DDPM-F); a ConfigError names the fix for other shapes. Unset widths take Table XV's sizes:
  CIFAR-10's (DCGAN d_g = 256, d_d = 64; CVAE l = 50) where `cifar10_sizes` (default: 3-channel images), else
  MNIST's (128, 128; l = 16)."""
  h, w, c = input_shape
  cifar10 = (c == 3 and not features) if cifar10_sizes is None else cifar10_sizes
  size = 16 if features else 32
  if (h, w) != (size, size):
    raise ConfigError(f'GeFL\'s generators emit 32x32 images (GeFL-F\'s 16x16 feature maps); the data are {h}x{w}. '
                      f'Fix: Dataset.resized(32) (GeFL resizes MNIST 28 -> 32).')
  if cfg.generator == 'dcgan':
    g_width, d_width = (cfg.width, cfg.width) if cfg.width else ((256, 64) if cifar10 else (128, 128))
    return dcgan(num_classes, c, g_width, d_width, conv=conv, size=size)
  if cfg.generator == 'cvae':
    latent = cfg.latent or (50 if cifar10 else 16)
    return cvae(num_classes, c, cfg.width or 64, latent, conv=conv, size=size)
  return ddpm(num_classes, c, h, cfg.width or 128, cfg.diffusion_steps, cfg.guidance, conv=conv)


class GeneratorState(NamedTuple):
  """A client's extra state: its copy of the generator's variables and its own optimizer state."""
  generator: dict
  optimizer: Any


class TargetModel(NamedTuple):
  """A target network as it crosses: params and BatchNorm statistics (GeFL's code loads the whole state dict)."""
  params: dict
  model_state: dict


class GeFLServer(NamedTuple):
  """The server: the generator, its round count (generator rounds done) and each group's `TargetModel`."""
  generator: dict
  generator_round: jnp.ndarray
  models: tuple


class GeFLBroadcast(NamedTuple):
  """What a group's clients receive: the generator and its round count, and in target rounds the group's model
  (None in knowledge rounds)."""
  generator: dict
  generator_round: jnp.ndarray
  model: Any = None


class GeFLUpload(NamedTuple):
  """A client's upload: its trained target model (target rounds) and its generator (knowledge rounds, and target
  rounds in update mode); None where not sent."""
  model: Any = None
  generator: Any = None


def generator_step(gen: ConditionalGenerator, lr_scale, inputs=None):
  """(client, batch, broadcast, key) -> (client, loss): one generator update on a real batch with the client's own
  optimizer state; inputs(x, broadcast) -> what the generator learns (default: the images mapped into its range;
  GeFL-F: the shared extractor's features); lr_scale(broadcast) multiplies the rate."""
  inputs = inputs or (lambda x, broadcast: to_generator_range(x, gen.unit_range))

  def step(client, batch: Batch, broadcast, key):
    variables, opt, loss = gen.step(client.extra.generator, client.extra.optimizer,
                                    inputs(batch.x, broadcast), batch.y, key, lr_scale(broadcast), batch.mask)
    return client._replace(extra=GeneratorState(variables, opt)), loss
  return step


def synthetic_batch(gen: ConditionalGenerator, variables, key: jax.Array, batch_size: int, num_classes: int,
                    match_range: bool) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(images, labels) of one synthetic target step: labels uniform over all classes (not the client's label mix),
  images G(z | y) in eval mode, mapped into the classifiers' range [-1, 1] when `match_range` (else the
  generator's own, the code's mismatch), constants for the target's gradients."""
  label_key, sample_key = jax.random.split(key)
  labels = uniform_labels(label_key, batch_size, num_classes)
  images = gen.sample(variables, labels, sample_key)
  if match_range:
    images = from_generator_range(images, gen.unit_range)
  return jax.lax.stop_gradient(images), labels


def ddpm_lr_scale(cfg: GeFLConfig):
  """broadcast -> the generator's rate factor: for DDPM 1 - t / T_KA in the t-th (1-based) generator round, as the
  code; 1 for the others."""
  def scale(broadcast):
    if cfg.generator != 'ddpm':
      return 1.0
    return jnp.maximum(1.0 - (broadcast.generator_round + 1) / cfg.ka_rounds, 0.0)
  return scale


def with_shared_first_block(models: tuple, uploads: RoundUploads) -> tuple:
  """Each group's averaged model with its first block F replaced by F's unweighted mean over all participants of
  all groups (parameters and BatchNorm statistics; the code's `LGFedAvg` under avg_FE = 1)."""
  fe = lambda model: split_client(model.params, model.model_state)[0]
  shared = uploads.mean(lambda values: jax.vmap(fe)(values.model), previous=fe(models[0]))
  out = []
  for model in models:
    params, model_state = join_client(shared, split_client(model.params, model.model_state)[1], model.model_state)
    out.append(TargetModel(params, model_state))
  return tuple(out)


def image_generator(cfg: GeFLConfig, num_classes: int, group: GroupSpec) -> ConditionalGenerator:
  """The group's generator of its images."""
  return build_generator(cfg, num_classes, group.input_shape, group.conv)


def init_generator_extra(make_generator: Callable[[GroupSpec], ConditionalGenerator], group: GroupSpec,
                         key: jax.Array) -> GeneratorState:
  """A client's generator (the same initialisation on every client) and its own optimizer state."""
  gen = make_generator(group)
  variables = gen.init(group.shared_key('gefl_generator'))
  return GeneratorState(variables, gen.init_optimizer(variables))


def init_server(key: jax.Array, spec, initial) -> GeFLServer:
  """The first client's generator, the generator's round count, and each group's first model."""
  return GeFLServer(initial[0].extra.generator, jnp.zeros((), jnp.int32),
                    tuple(TargetModel(s.params, s.model_state) for s in initial))


def average_generators(server, uploads):
  """The generator <- the unweighted mean of the participants' generators over all groups; its round count + 1.
  Only the generator crosses groups (target models differ in shape between architectures)."""
  generator = uploads.mean('generator', previous=server.generator)
  return server._replace(generator=generator, generator_round=server.generator_round + 1)


def knowledge_server(server, uploads, key: jax.Array) -> tuple[Any, dict]:
  """Knowledge aggregation (Alg. 1): the generators averaged."""
  return average_generators(server, uploads), {}


def receive_generator(client, broadcast):
  """The client's generator <- the server's (its optimizer state stays its own)."""
  return client._replace(extra=client.extra._replace(generator=broadcast.generator))


def generator_broadcast(server: GeFLServer, group) -> GeFLBroadcast:
  """The generator and its round count (the DDPM rate schedule reads the count)."""
  return GeFLBroadcast(server.generator, server.generator_round)


def upload_generator(client, rows, broadcast, key):
  """Uploads the client's generator (every variable: BatchNorm statistics and DCGAN's D too)."""
  return client, GeFLUpload(generator=client.extra.generator)


# ---------------------------------------------------------------- phase 'knowledge'
def knowledge_client(cfg: GeFLConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """The server's generator, trained T_g epochs on the client's real batches with its own optimizer state. No
  target network enters this program: it is the same for every group of one input shape and convolution, so
  executors compile it once."""
  step = generator_step(image_generator(cfg, num_classes, group), ddpm_lr_scale(cfg))
  return ClientProgram(lambda client, broadcast, key: receive_generator(client, broadcast),
                       (Stage(step, cfg.generator_epochs),), upload_generator, group.training,
                       identity=('gefl.knowledge', tuple(group.input_shape), group.conv, group.training))


# ---------------------------------------------------------------- phase 'target'
def target_broadcast(server: GeFLServer, group) -> GeFLBroadcast:
  """The generator and the group's model."""
  return generator_broadcast(server, group)._replace(model=server.models[group.index])


def receive_group_model(client, broadcast: GeFLBroadcast):
  """The client's target network <- its group's model."""
  return client._replace(params=broadcast.model.params, model_state=broadcast.model.model_state)


def target_client(cfg: GeFLConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """The group's model, trained T_s epochs on generated batches, then T_r epochs on real ones (Alg. 2); in update
  mode the generator then trains T_g epochs too. Uploads the model (and the generator)."""
  update = cfg.mode == 'update'
  gen, optimizer = image_generator(cfg, num_classes, group), group.training.optimizer()

  def sgd_on(client, x, y, mask):
    def loss(params):
      logits, _, state = forward(group.model, params, client.model_state, x, True, mask)
      return cross_entropy(logits, y, mask), state
    (value, state), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    return client._replace(params=descend(optimizer, client.params, grads), model_state=state), value

  def synthetic_step(client, batch: Batch, broadcast, key):
    images, labels = synthetic_batch(gen, broadcast.generator, key, group.training.batch_size, num_classes,
                                     cfg.match_range)
    return sgd_on(client, images, labels, batch.mask)

  def real_step(client, batch: Batch, broadcast, key):
    return sgd_on(client, batch.x, batch.y, batch.mask)

  def init(client, broadcast, key):
    client = receive_group_model(client, broadcast)
    return receive_generator(client, broadcast) if update else client

  def final(client, rows, broadcast, key):
    return client, GeFLUpload(TargetModel(client.params, client.model_state),
                              client.extra.generator if update else None)

  stages = (Stage(synthetic_step, cfg.synthetic_epochs, generated=True), Stage(real_step, group.training.epochs))
  if update:
    stages += (Stage(generator_step(gen, ddpm_lr_scale(cfg)), cfg.generator_epochs),)
  return ClientProgram(init, stages, final, group.training)


def target_server(cfg: GeFLConfig, server: GeFLServer, uploads, key: jax.Array) -> tuple[GeFLServer, dict]:
  """Each group's model <- the unweighted mean of its participants' (Alg. 2; the first block over all clients
  under --gefl_share_first_block); the generators averaged too in update mode."""
  models = uploads.group_mean('model', previous=server.models)
  if cfg.share_first_block:
    models = with_shared_first_block(models, uploads)
  server = server._replace(models=models)
  return (average_generators(server, uploads) if cfg.mode == 'update' else server), {}


def evaluation(group: GroupSpec):
  """Every client scored with its group's model. Knowledge rounds broadcast no target model: scored there (only
  when a caller asks), a client is its own."""
  receive = lambda client, broadcast: receive_group_model(client, broadcast) if broadcast.model is not None else client
  return head_evaluation(group.model, {'group_model': own_head}, receive=receive)


def generated_samples(cfg: GeFLConfig, num_classes: int, server: GeFLServer, spec, key: jax.Array, n: int):
  """[C, n, H, W, c]: n samples per class from the server's generator, in [-1, 1]."""
  gen = image_generator(cfg, num_classes, spec.groups[0])
  labels = jnp.repeat(jnp.arange(num_classes), n)
  images = from_generator_range(gen.sample(server.generator, labels, key), gen.unit_range)
  return jnp.clip(images, -1.0, 1.0).reshape((num_classes, n) + images.shape[1:])


def sent_scalars(cfg: GeFLConfig, tree) -> dict:
  """The models and generators that cross (an upload or broadcast's parts that are not None); in freeze mode a
  target round's broadcast carries the generator only for the engine (clients hold the final one from the last
  knowledge round: not counted again)."""
  model, generator = tree.model, tree.generator
  out = {'model': sum(leaf_scalars(model).values())} if model is not None else {}
  if generator is not None and (cfg.mode == 'update' or model is None):
    out['generator'] = sum(leaf_scalars(generator).values())
  return out


def gefl(cfg: GeFLConfig, num_classes: int, rounds: int) -> Algorithm:
  """GeFL as an `Algorithm` of two phases: 'knowledge' (cfg.knowledge_rounds rounds) and 'target' (`rounds`)."""
  scalars = functools.partial(sent_scalars, cfg)
  knowledge = Phase('knowledge', functools.partial(knowledge_client, cfg, num_classes), knowledge_server,
                    generator_broadcast, rounds=cfg.knowledge_rounds, evaluate=False, traffic=Traffic(scalars, scalars))
  target = Phase('target', functools.partial(target_client, cfg, num_classes), functools.partial(target_server, cfg),
                 target_broadcast, rounds=rounds, traffic=Traffic(scalars, scalars))
  return Algorithm('gefl', init_server, (knowledge, target), evaluation,
                   init_client=functools.partial(init_generator_extra,
                                                 functools.partial(image_generator, cfg, num_classes)),
                   samples=functools.partial(generated_samples, cfg, num_classes),
                   capabilities=Capabilities(partial_batches=True, shares_representations=False))
