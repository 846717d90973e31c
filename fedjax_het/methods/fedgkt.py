"""FedGKT (He, Annavaram and Avestimehr, NeurIPS 2020, "Group knowledge transfer: federated learning of large CNNs
at the edge"), as Felo's Fig. 4 and Tables 2-3 run it ("Exploiting Features and Logits in Heterogeneous Federated
Learning", Sec. 4: every client each round, "evaluated on the server side", by the large server model).

Each client trains its own small model (its group's classifier: extractor, RM, head), never averaged, with its own
optimizer kept across rounds, on
  CE(z_c, y) + alpha * T^2 * KL(softmax(z_s / T) || softmax(z_c / T))              (the paper's Eq. 5, client side)
where z_s are the server's logits of the same training row from the last round (KL summed over classes, averaged
over the batch's real rows: FedGKT's KL_Loss, kl_div 'batchmean'); before the server has sent any (round 1) the
term is left out, as in its code. After training it uploads, for every training row, the extractor's eval-mode
output h (the feature map before RM; a vector for extractors that end in one) and its eval-mode logits z_c, with
the labels; with --gkt_split=stem, h is instead the output of its ResNet's stem, where the code cuts its client
(`resnet8_gkt`, the code's ResNet-8: 16 x 32 x 32 maps on CIFAR, which the server's ResNet-56 takes from its first
stage).

The server holds a large model, `models.resnet.StemlessResNet` (--gkt_server_blocks bottlenecks per stage: 6 is the
code's ResNet-56 server, 12 ResNet-110), trained on the uploaded maps for --gkt_server_epochs epochs each round:
clients in order, each client's rows in batches of --batch_size in one random order for the round (the code replays
the batches of the client's shuffled extraction pass in the same order every epoch), with CE(z_s, y) (the code's
default, whether_distill_on_the_server=0), or with --gkt_server_distill T^2 KL(softmax(z_c / T) || softmax(z_s / T))
+ alpha * CE (the code's weighting when it distils). Its logits of each row in the last epoch (training mode, before
that batch's step, as the code takes them) go back to that client alone (`core.PerClient`). Optimizers
(--gkt_optimizer, one kept by each client and one by the server, both at --gkt_learning_rate, the code's one
--lr; --local_learning_rate is not read): 'adam', the code's Adam (amsgrad, L2 1e-4), which its README run uses
at 1e-3; 'sgd', momentum 0.9 Nesterov, L2 5e-4 (its default optimizer).

Scored ('server_model', reported): every client's test rows through its own extractor, then the server model,
eval mode (the code evaluates the server model on each client's uploaded test features); 'client_model': the
client's own classifier.

Choices: the code looks the server's logits up by batch index while its loader reshuffles every epoch, so a row is
distilled towards another row's logits; here each row gets its own (keyed by the row). Every training row is
uploaded (the code's pass drops the last partial batch). Groups whose extractors end in different channel counts
(heterogeneous clients; the code's clients are all ResNet-8) each get a learned Dense (a 1x1 convolution) to the
largest count at the server, trained with the server model; groups with equal counts get none. The server's
ReduceLROnPlateau('max') (factor 0.1, patience 10, its other defaults; --gkt_plateau_factor, --gkt_plateau_patience) is
stepped every round, on the server's accuracy over the uploaded training rows in its last epoch (the code steps it on
its best accuracy on the clients' uploaded test features, which this server does not hold). The client's pretrained
start (the code loads a ResNet-8 trained beforehand) is not reproduced. Its CIFAR loaders' augmentation is
--augment=crop_flip_cutout; as the code extracts the uploaded maps through its training loader, each uploaded row is
augmented too (one draw per row and round, from the round's key). Its KL_Loss adds 1e-7 to the teacher's probabilities, left out here (one server round
against a PyTorch loop of its code, with it, agrees within float32 tolerance: tests/test_torch_baselines.py).
Uploads hold per-row labels, so FedGKT is refused under DP (labels are not floating point).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import (Algorithm, Capabilities, ClientProgram, Evaluation, FederationSpec, GroupSpec, PerClient,
                             Traffic, hyperparameter, one_phase, single_stage)
from fedjax_het.data.augment import augment_batch
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import KeptOptimizer, kept_optimizer_step, zero_params
from fedjax_het.methods.shared.common import cross_entropy, distillation_loss, train_forward
from fedjax_het.models.conv import conv_factory
from fedjax_het.models.norm import batch_rows
from fedjax_het.models.resnet import StemlessResNet
from fedjax_het.models.shapes import variable_shapes
from fedjax_het.optim import torch_amsgrad
from fedjax_het.rows import shuffled_real_rows

OPTIMIZERS = ('adam', 'sgd')
SPLITS = ('extractor', 'stem')


@dataclasses.dataclass(frozen=True)
class FedGKTConfig:
  """FedGKT's distillation and server training (its code's defaults; Adam as its README runs it)."""
  temperature: float = hyperparameter(3.0, 'FedGKT: distillation temperature T (client and server).',
                                      flag='gkt_temperature')
  alpha: float = hyperparameter(1.0, 'FedGKT: weight of the client\'s distillation term (with --gkt_server_distill, '
                                     'of the server\'s CE).', flag='gkt_alpha')
  server_epochs: int = hyperparameter(20, 'FedGKT: epochs of the server model over the uploaded features per round.',
                                      flag='gkt_server_epochs')
  server_blocks: int = hyperparameter(6, 'FedGKT: bottleneck blocks per stage of the server ResNet (6: ResNet-56, '
                                         '12: ResNet-110).', flag='gkt_server_blocks')
  server_distill: bool = hyperparameter(False, 'FedGKT: the server also distils from the clients\' logits.',
                                        flag='gkt_server_distill')
  optimizer: str = hyperparameter('adam', 'FedGKT: both sides\' optimizer, kept across rounds: adam (amsgrad, L2 '
                                          '1e-4) or sgd (momentum 0.9 Nesterov, L2 5e-4).', flag='gkt_optimizer')
  learning_rate: float = hyperparameter(1e-3, 'FedGKT: both sides\' learning rate (its README run: Adam at 1e-3).',
                                        flag='gkt_learning_rate')
  split: str = hyperparameter('extractor', "FedGKT: what a client uploads for each row: 'extractor', its extractor's "
                                           "output (the map before RM); 'stem', a ResNet's stem output, where its "
                                           "code cuts the client (resnet8_gkt: 16 x 32 x 32 on CIFAR).",
                              flag='gkt_split')
  plateau_factor: float = hyperparameter(0.1, 'FedGKT: the server\'s ReduceLROnPlateau(\'max\') factor on its learning '
                                              'rate, stepped every round on its accuracy (its code\'s default 0.1; 1: '
                                              'off).', flag='gkt_plateau_factor')
  plateau_patience: int = hyperparameter(10, 'FedGKT: rounds without a better server accuracy before the rate is '
                                             'multiplied by --gkt_plateau_factor (ReduceLROnPlateau\'s default 10).',
                                         flag='gkt_plateau_patience')

  def __post_init__(self):
    if self.optimizer not in OPTIMIZERS:
      raise ConfigError(f'{setting(self, "optimizer")}: choose one of {", ".join(OPTIMIZERS)}.')
    if self.split not in SPLITS:
      raise ConfigError(f'{setting(self, "split")}: choose one of {", ".join(SPLITS)}.')
    if self.temperature <= 0 or self.alpha < 0 or self.learning_rate <= 0:
      raise ConfigError(f'{setting(self, "temperature")} and {setting(self, "learning_rate")} must be > 0 and '
                        f'{setting(self, "alpha")} >= 0.')
    if not 0 < self.plateau_factor <= 1 or self.plateau_patience < 0:
      raise ConfigError(f'{setting(self, "plateau_factor")} must be in (0, 1] (1: no plateau schedule) and '
                        f'{setting(self, "plateau_patience")} >= 0.')
    if self.server_epochs < 0 or self.server_blocks < 1:
      raise ConfigError(f'{setting(self, "server_epochs")} must be >= 0 and {setting(self, "server_blocks")} >= 1.')


def gkt_optimizer(kind: str, learning_rate: float) -> optax.GradientTransformation:
  """FedGKT's optimizers: 'adam', torch's Adam(amsgrad=True, weight_decay=1e-4); 'sgd', torch's SGD(momentum=0.9,
  nesterov=True, weight_decay=5e-4) (L2 added to the gradient in both)."""
  if kind == 'adam':
    return optax.chain(optax.add_decayed_weights(1e-4), torch_amsgrad(learning_rate))
  return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(learning_rate, momentum=0.9, nesterov=True))


PLATEAU_THRESHOLD = 1e-4  # torch's ReduceLROnPlateau defaults: threshold 1e-4 ('rel'), cooldown 0, min_lr 0, eps 1e-8
PLATEAU_EPS = 1e-8


class Plateau(NamedTuple):
  """torch's ReduceLROnPlateau(mode='max') over the server's optimiser: scale, the factor its learning rate is at;
  best, the best metric seen (-inf at first); bad, the steps since it last improved by more than the threshold."""
  scale: jnp.ndarray
  best: jnp.ndarray
  bad: jnp.ndarray


def plateau_init() -> Plateau:
  return Plateau(jnp.float32(1.0), jnp.float32(-jnp.inf), jnp.int32(0))


def plateau_step(plateau: Plateau, metric, factor: float, patience: int, learning_rate: float) -> Plateau:
  """One `scheduler.step(metric)` of torch's ReduceLROnPlateau('max', factor, patience) with its other defaults: a
  metric above best * (1 + 1e-4) is an improvement; after more than `patience` steps without one the rate is
  multiplied by `factor` (unless that changes it by no more than eps = 1e-8) and the count starts again."""
  better = metric > plateau.best * (1.0 + PLATEAU_THRESHOLD)
  best = jnp.where(better, metric, plateau.best)
  bad = jnp.where(better, 0, plateau.bad + 1)
  reduce = bad > patience
  lowered = plateau.scale * factor
  scale = jnp.where(reduce & (learning_rate * (plateau.scale - lowered) > PLATEAU_EPS), lowered, plateau.scale)
  return Plateau(scale.astype(jnp.float32), best.astype(jnp.float32), jnp.where(reduce, 0, bad).astype(jnp.int32))


def client_kd_loss(client_logits: jnp.ndarray, server_logits: jnp.ndarray, temperature: float,
                   rows: Optional[jnp.ndarray] = None) -> jnp.ndarray:
  """T^2 KL(softmax(z_s / T) || softmax(z_c / T)), summed over classes and averaged over the rows: FedGKT's
  KL_Loss with the client as student (on the server with --gkt_server_distill, the roles swap)."""
  return temperature ** 2 * distillation_loss(client_logits, server_logits, temperature, rows)


def extract(model, params: Any, model_state: Any, x: jnp.ndarray, split: str = 'extractor'
            ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Eval mode (what the client uploads of x [B, ...]: the extractor's output, or with split 'stem' the map its
  ResNet's stem sows; the classifier's logits [B, C])."""
  def both(m, x):
    h = m.extractor(x, train=False)
    return h, m.classify(m.features_of(h))
  variables = {'params': params, **model_state}
  if split == 'extractor':
    return model.apply(variables, x, method=both)
  (_, logits), sown = model.apply(variables, x, method=both, mutable=['intermediates'])
  stem = sown.get('intermediates', {}).get('extractor', {}).get('stem')
  if stem is None:
    raise ConfigError('FedGKTConfig.split=\'stem\': this client\'s architecture has no ResNet stem to cut after. Fix: '
                      'a ResNet (e.g. resnet8_gkt, FedGKT\'s client), or FedGKTConfig.split=\'extractor\'.')
  return stem[0], logits


class ServerModel:
  """FedGKT's server model over a federation's groups: a Dense to the widest group's channel count for each group
  narrower than it (heterogeneous extractors), then the stemless ResNet. Parameters {'trunk', 'adapters': one per
  group, {} where none}; `apply_server` runs it on one group's maps."""

  def __init__(self, spec: FederationSpec, num_classes: int, blocks: int, split: str = 'extractor'):
    self.map_shapes = [map_shape(g, split) for g in spec.groups]
    self.width = max(s[-1] for s in self.map_shapes)
    self.trunk = server_trunk(num_classes, blocks, spec.groups[0])

  def init(self, key: jax.Array) -> tuple[dict, dict]:
    """(params, non-trainable state) of a fresh server model."""
    k_trunk, k_adapt = jax.random.split(key)
    adapters = tuple(nn.Dense(self.width).init(jax.random.fold_in(k_adapt, gi), jnp.zeros((1, s[-1])))['params']
                     if s[-1] != self.width else {} for gi, s in enumerate(self.map_shapes))
    sample = jnp.zeros((2,) + tuple(self.map_shapes[0][:-1]) + (self.width,))
    variables = self.trunk.init(k_trunk, sample, train=False)
    return {'trunk': variables['params'], 'adapters': adapters}, {k: v for k, v in variables.items() if k != 'params'}


def apply_server(trunk: StemlessResNet, params: dict, state: dict, h: jnp.ndarray, train: bool,
                 mask: Optional[jnp.ndarray] = None) -> tuple[jnp.ndarray, dict]:
  """(logits [B, C], new state) of the server model on one group's maps h [B, ...]: params {'trunk', 'adapter'}
  (the group's Dense, {} for none); training-mode BatchNorm statistics over the rows of mask."""
  if params['adapter']:
    h = h @ params['adapter']['kernel'] + params['adapter']['bias']
  variables = {'params': params['trunk'], **state}
  if not train:
    return trunk.apply(variables, h, train=False), state
  with batch_rows(mask):
    logits, updated = trunk.apply(variables, h, train=True, mutable=list(state))
  return logits, dict(updated)


def server_trunk(num_classes: int, blocks: int, group: GroupSpec) -> StemlessResNet:
  """The server's stemless ResNet, with the run's convolutions (--conv: on a CPU, XLA's own run many times slower
  than oneDNN's inside the server's loop, benchmarks/fedgkt_server_conv.py)."""
  return StemlessResNet(num_classes, blocks, conv=conv_factory(group.conv))


def map_shape(group: GroupSpec, split: str = 'extractor') -> tuple[int, ...]:
  """The per-row shape of what the group's clients upload (`extract`)."""
  variables = variable_shapes(group.model, group.input_shape)
  out = jax.eval_shape(lambda v: extract(group.model, v['params'], {k: s for k, s in v.items() if k != 'params'},
                                         group.sample_input(), split), variables)
  return tuple(out[0].shape[1:])


class ServerLogits(NamedTuple):
  """The server's logits of one client's training rows [n, C] and whether it has sent any yet (has)."""
  logits: jnp.ndarray
  has: jnp.ndarray


class FedGKTBroadcast(NamedTuple):
  """What a group's clients receive: model, the server model's trunk and the group's adapter; state, its BatchNorm
  statistics; own, each client's `ServerLogits` (a `PerClient` part: a client reads its own)."""
  model: dict
  state: dict
  own: PerClient


class FedGKTUpload(NamedTuple):
  """A client's upload: features [n, ...], its maps of every training row; logits [n, C], its own logits; y [n];
  rows [n], which rows are real; received, whether it had server logits this round (for the traffic count)."""
  features: jnp.ndarray
  logits: jnp.ndarray
  y: jnp.ndarray
  rows: jnp.ndarray
  received: jnp.ndarray


class FedGKTServer(NamedTuple):
  """The server: model ({'trunk', 'adapters': one per group}) and state, the large model's params and BatchNorm
  statistics; optimizer, their optimizer states (kept across rounds); logits and has, per group [clients, n, C]
  and [clients], its logits of each client's rows and whether it has any; plateau, its learning rate's
  ReduceLROnPlateau."""
  model: dict
  state: dict
  optimizer: dict
  logits: tuple
  has: tuple
  plateau: Plateau


def client_program(cfg: FedGKTConfig, optimizer: optax.GradientTransformation, group: GroupSpec) -> ClientProgram:
  """A client's round: CE plus the distillation term towards the server's logits of each row (once it has any),
  its optimiser kept; it uploads every training row's map (`extract`), logits and label."""
  T = cfg.temperature

  def loss(client, batch, broadcast):
    logits, _, client = train_forward(group.model, client, batch.x, batch.mask)
    mine = broadcast.own.values
    kd = client_kd_loss(logits, mine.logits[batch.index], T, batch.mask)
    return cross_entropy(logits, batch.y, batch.mask) + cfg.alpha * jnp.where(mine.has, kd, 0.0), client

  training = group.training

  def final(client, rows, broadcast, key):
    real = jnp.arange(rows.x.shape[0]) < rows.num_train

    def one(x, row):  # the code extracts through its training loader: each row augmented as in training
      x = augment_batch(x[None], jax.random.fold_in(key, row), training.augment, training.augment_fill)
      return jax.tree.map(lambda a: a[0], extract(group.model, client.params, client.model_state, x, cfg.split))
    h, logits = jax.lax.map(lambda a: one(*a), (rows.x, jnp.arange(rows.x.shape[0])), batch_size=64)
    zero = lambda a: jnp.where(real.reshape((-1,) + (1,) * (a.ndim - 1)), a, 0)
    return client, FedGKTUpload(zero(h), zero(logits), zero(rows.y), real, broadcast.own.values.has)

  return ClientProgram(lambda client, broadcast, key: client, single_stage(kept_optimizer_step(optimizer, loss),
                                                                          group.training),
                       final, group.training)


def server_evaluation(cfg: FedGKTConfig, num_classes: int, group: GroupSpec) -> Evaluation:
  """'server_model': the client's extractor, then the server model; 'client_model': the client's own."""
  trunk_net = server_trunk(num_classes, cfg.server_blocks, group)

  def prepare(client, broadcast):
    return client.params, client.model_state, broadcast.model, broadcast.state

  def logits(evaluated, x):
    params, model_state, server_model, server_state = evaluated
    h, own = extract(group.model, params, model_state, x, cfg.split)
    return apply_server(trunk_net, server_model, server_state, h, False)[0], own
  return Evaluation(('server_model', 'client_model'), prepare, logits)


def server_pass(cfg: FedGKTConfig, optimizer: optax.GradientTransformation, trunk_net: StemlessResNet,
                batch_size: int):
  """group_pass(carry, u, order, scale): one pass of the server model over a group's uploaded rows (its slots in
  order, each slot's rows in `order`) in batches, its trunk and the group's adapter stepped on each at `scale`
  times the learning rate (torch's rate multiplies the whole step, in Adam and in SGD with momentum)."""
  T = cfg.temperature

  def objective(params, state, h, z_c, y, valid):
    z_s, state = apply_server(trunk_net, params, state, h, True, valid)
    ce = cross_entropy(z_s, y, valid)
    value = (client_kd_loss(z_s, z_c, T, valid) + cfg.alpha * ce) if cfg.server_distill else ce
    return value, (z_s, state)

  def group_pass(carry, u, order, scale):
    """One pass over a group's uploaded rows: its slots in order, each slot's rows in `order` [S, n] (a random
    order of its real rows, then padding) in batches."""
    rows = u.participant_rows('rows')
    slots, n = rows.shape
    steps = math.ceil(n / batch_size)

    def step(carry, t):
      params, state, opts, out, total, count = carry
      s, b = t // steps, t % steps
      r = b * batch_size + jnp.arange(batch_size)
      rc = order[s, jnp.minimum(r, n - 1)]
      valid = (r < n) & rows[s, rc]
      # The batch's padding repeats its first real row: a padding row normalised by statistics that are not its
      # own grows through the server's dozens of BatchNorms until it overflows, and 0 * inf in the masked loss
      # is NaN. Its output is never counted (the loss and the statistics read only the real rows).
      picked = jnp.where(valid, rc, rc[jnp.argmax(valid)])
      (value, (z_s, new_state)), grads = jax.value_and_grad(objective, has_aux=True)(
          params, state, u.values.features[s, picked], u.values.logits[s, picked], u.values.y[s, picked],
          valid)
      # The trunk and the group's adapter keep optimizer states of their own (torch's Adam counts steps per
      # parameter, and the other groups' adapters take no step here).
      updated = {part: optimizer.update(grads[part], opts[part], params[part]) for part in params}
      new = ({part: optax.apply_updates(params[part], jax.tree.map(lambda d: d * scale, updated[part][0]))
              for part in params}, new_state,
             {part: updated[part][1] for part in params})
      # A batch without real rows is no step (momentum and weight decay would still move the parameters).
      any_row = valid.any()
      params, state, opts = jax.tree.map(lambda a, b: jnp.where(any_row, a, b), new, (params, state, opts))
      out = out.at[s, jnp.where(valid, rc, n)].set(z_s, mode='drop')  # real rows only: a clipped index repeats
      total = total + jnp.where(any_row, value * valid.sum(), 0.0)
      return (params, state, opts, out, total, count + valid.sum()), None
    carry, _ = jax.lax.scan(step, carry, jnp.arange(slots * steps))
    return carry

  return group_pass


def server_round(cfg: FedGKTConfig, group_pass, server: FedGKTServer, uploads, key: jax.Array
                 ) -> tuple[FedGKTServer, dict]:
  """The server's round: --gkt_server_epochs passes over every group's uploaded rows (`server_pass`), then each
  participant's rows' logits of the last pass kept for it."""
  # Each client's rows in one random order for the round (the code's server replays the batches of the
  # client's shuffled extraction pass, in the same order every epoch; a client's stored rows may be sorted by
  # class, and one-class batches would teach the server nothing).
  orders = [jax.vmap(lambda k, valid: shuffled_real_rows(k, valid))(
      jax.random.split(jax.random.fold_in(key, gi), u.mask.shape[0]), u.participant_rows('rows'))
      for gi, u in enumerate(uploads)]

  def epoch(carry, _):
    trunk, adapters, state, trunk_opt, adapter_opts, outs, total, count = carry
    adapters, adapter_opts, outs = list(adapters), list(adapter_opts), list(outs)
    for gi, u in enumerate(uploads):
      params = {'trunk': trunk, 'adapter': adapters[gi]}
      opts = {'trunk': trunk_opt, 'adapter': adapter_opts[gi]}
      (params, state, opts, outs[gi], total, count) = group_pass((params, state, opts, outs[gi], total, count),
                                                                 u, orders[gi], server.plateau.scale)
      trunk, adapters[gi], trunk_opt, adapter_opts[gi] = (params['trunk'], params['adapter'], opts['trunk'],
                                                          opts['adapter'])
    return (trunk, tuple(adapters), state, trunk_opt, tuple(adapter_opts), tuple(outs), total, count), None

  start = (server.model['trunk'], server.model['adapters'], server.state, server.optimizer['trunk'],
           server.optimizer['adapters'], tuple(jnp.zeros(u.values.logits.shape) for u in uploads),
           jnp.float32(0), jnp.float32(0))
  (trunk, adapters, state, trunk_opt, adapter_opts, outs, total, count), _ = jax.lax.scan(
      epoch, start, None, length=cfg.server_epochs)
  logits, has = list(server.logits), list(server.has)
  # The code steps its ReduceLROnPlateau every round on the server model's best test accuracy so far (on the
  # clients' uploaded test features); this server holds no test rows, and steps it on its accuracy on the uploaded
  # training rows in the round's last epoch (the code's train_accTop1).
  right = sum(((jnp.argmax(o, -1) == u.values.y) & u.participant_rows('rows')).sum() for o, u in zip(outs, uploads))
  seen = sum(u.participant_rows('rows').sum() for u in uploads)
  accuracy = right / jnp.maximum(seen, 1)
  plateau = server.plateau
  if cfg.server_epochs > 0:
    plateau = plateau_step(plateau, accuracy, cfg.plateau_factor, cfg.plateau_patience, cfg.learning_rate)
  for gi, u in enumerate(uploads):
    who = jnp.where(u.mask, u.client, logits[gi].shape[0])  # absent slots write nothing
    logits[gi] = logits[gi].at[who].set(outs[gi], mode='drop')
    has[gi] = has[gi].at[who].set(cfg.server_epochs > 0, mode='drop')
  new = FedGKTServer({'trunk': trunk, 'adapters': adapters}, state, {'trunk': trunk_opt, 'adapters': adapter_opts},
                     tuple(logits), tuple(has), plateau)
  return new, {'server_loss': total / jnp.maximum(count, 1.0), 'server_train_accuracy': accuracy,
               'server_lr_scale': plateau.scale}


def fedgkt(cfg: FedGKTConfig, num_classes: int) -> Algorithm:
  """FedGKT as an `Algorithm`."""
  optimizer = gkt_optimizer(cfg.optimizer, cfg.learning_rate)

  def init_server(key, spec: FederationSpec, initial) -> FedGKTServer:
    net = ServerModel(spec, num_classes, cfg.server_blocks, cfg.split)
    # One program: eagerly, the server ResNet's initialisation compiles an op per layer.
    params, state = jax.jit(net.init)(spec.groups[0].maker.shared_key('fedgkt_server'))
    return FedGKTServer(params, state, {'trunk': optimizer.init(params['trunk']),
                                        'adapters': tuple(optimizer.init(a) for a in params['adapters'])},
                        tuple(jnp.zeros((len(g.clients), g.train_rows, num_classes)) for g in spec.groups),
                        tuple(jnp.zeros(len(g.clients), bool) for g in spec.groups), plateau_init())

  def broadcast(server: FedGKTServer, group: GroupSpec) -> FedGKTBroadcast:
    gi = group.index
    return FedGKTBroadcast({'trunk': server.model['trunk'], 'adapter': server.model['adapters'][gi]}, server.state,
                           PerClient(ServerLogits(server.logits[gi], server.has[gi])))

  def init_client(group, key):
    return KeptOptimizer(optimizer.init(zero_params(group)))

  def server_for(spec: FederationSpec):
    group_pass = server_pass(cfg, optimizer, server_trunk(num_classes, cfg.server_blocks, spec.groups[0]),
                             spec.training.batch_size)

    return lambda server, uploads, key: server_round(cfg, group_pass, server, uploads, key)

  def upload_scalars(upload: FedGKTUpload):
    real = upload.rows.sum()
    return {'features': real * math.prod(upload.features.shape[1:]), 'logits': real * num_classes,
            'labels': real}

  def received_scalars(broadcast, upload: FedGKTUpload):
    """The server's logits of the client's rows, once the server has sent any (`FedGKTUpload.received`)."""
    return {'server_logits': upload.rows.sum() * num_classes * upload.received}

  algorithm = one_phase('fedgkt', init_server, lambda group: client_program(cfg, optimizer, group), server_for,
                        lambda group: server_evaluation(cfg, num_classes, group), broadcast=broadcast,
                        init_client=init_client,
                        capabilities=Capabilities(partial_batches=True, shares_representations=False),
                        traffic=Traffic(upload=upload_scalars, received=received_scalars))
  phase = dataclasses.replace(algorithm.phases[0], server_of_spec=True)
  return dataclasses.replace(algorithm, phases=(phase,))
