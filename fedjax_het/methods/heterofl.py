"""HeteroFL (Diao et al., ICLR 2021, "HeteroFL: Computation and communication efficient federated learning for
heterogeneous clients"), as Felo's Fig. 4 runs it ("Exploiting Features and Logits in Heterogeneous Federated Learning",
Sec. 4: sub-models of the largest ResNet with smaller widths and the same depth, evaluated on the server).

The architecture groups are one architecture at several width rates, `--models=resnet26@1,resnet26@0.5,...`
(`models.registry`: every hidden width w becomes ceil(rate * w)). The server holds the global model, the widest
group's; a participant receives its sub-model, the leading slice of every parameter (the first ceil(rate * w)
channels of each layer), trains it and uploads it with the classes it holds. The server averages every entry of the
global model over the participants whose sub-model holds it, unweighted; an entry nobody held keeps its value; the
output layer's row of class c counts only the participants holding c (HeteroFL's label split, `combine`).

Training: CE with the logits of classes the client does not hold set to 0 (HeteroFL's `masked_fill(label_mask ==
0, 0)`, --heterofl_mask), SGD at --local_learning_rate with momentum --heterofl_momentum and weight decay
--heterofl_weight_decay (HeteroFL's 0.9 and 5e-4), each step's gradient first clipped to global norm
--heterofl_clip_norm (its code's 1), a fresh optimizer every round, its rate multiplied by --heterofl_lr_decay at
each round of --heterofl_lr_milestones (its code's MultiStepLR, stepped every round; off by default). Its static
BatchNorm keeps no running statistics for training; every client is scored with the global model (Felo: "evaluated on the server
side").

Static BatchNorm (sBN, --heterofl_static_bn, the default): before each evaluation the global model runs in train
mode over every client's training rows (`Evaluation.statistics`: the paper's server querying its clients), and its
BatchNorm layers are scored with the mean of the batch statistics of its batches of --batch_size rows, each weighted
by its rows (HeteroFL's `stats` pass averages its train loader's batches equally; the variances are unbiased in
both; the pass is not counted in the communication). As HeteroFL's `stats` reads its shuffled train loader with its
crop and flip, each client's rows are visited in a random order drawn from the round's key and each batch is
augmented as a training batch is (--augment): in stored order a client's rows can be grouped by class (the global
protocol's partition), and batches of one class leave the spread between classes out of every variance. The code's
pass shuffles the whole training set, so its batches mix clients; here each batch is one client's. Off, the global
model
normalises each test batch by the statistics of its real rows, so a score depends on the batch size. Not over
Flower: its nodes are not queried for statistics.
Under DP the classes a client holds (its label mask) are sent in the clear. Its Scaler (1 / rate
on every conv output during training) is left out: a BatchNorm follows every scaled convolution in both model
families and removes the factor. A client keeps its group's rate (--heterofl_split=fix, HeteroFL's 'fix'), or
(--heterofl_split=dynamic, its code's 'dynamic', which Felo ran) --models names the global model alone and every
participant draws its rate each round, uniformly from --heterofl_dynamic_rates (relative to the global model; its
code's a-e by default) with its round's key; it trains the global model with the entries outside that rate's
leading slices zero, which runs the same steps as the sliced sub-model (a convolution's dropped channels, with
their BatchNorm's scale and bias zero, stay zero and get no gradient), and uploads it with the rate's index; the
server averages each entry over the participants whose rate holds it. The traffic counts the sub-model. The models are HeteroFL's CNN
(`heterofl_conv`), its pre-activation ResNets with the 3x3 stem (`preact_resnet18`, `preact_resnet26`) and the
zoo's other ResNets; models that flatten a feature map into a Dense have no channel-sliceable sub-model and are
refused. Its CIFAR loader's random crop and flip are the run's `--augment=crop_flip`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_het.core import (Algorithm, Capabilities, ClientProgram, ClientState, Evaluation, GroupSpec, Traffic,
                             UploadPrivacy, hyperparameter, leaf_scalars, one_phase)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import sgd_program
from fedjax_het.methods.shared.common import cross_entropy
from fedjax_het.models.forward import forward
from fedjax_het.models.norm import batch_statistics
from fedjax_het.models.shapes import variable_shapes
from fedjax_het.optim import multistep_factor


@dataclasses.dataclass(frozen=True)
class HeteroFLConfig:
  """HeteroFL's local optimiser and label masking (its code's defaults)."""
  momentum: float = hyperparameter(0.9, 'HeteroFL: SGD momentum (a fresh optimiser every round).',
                                   flag='heterofl_momentum')
  weight_decay: float = hyperparameter(5e-4, 'HeteroFL: SGD weight decay.', flag='heterofl_weight_decay')
  lr_milestones: str = hyperparameter('', 'HeteroFL: comma-separated rounds (0-based) from which the local rate is '
                                           'multiplied by --heterofl_lr_decay once more (its code\'s MultiStepLR, '
                                           'stepped every round: 150,250 for CIFAR-10 IID); empty: a constant rate.',
                                     flag='heterofl_lr_milestones')
  lr_decay: float = hyperparameter(0.1, 'HeteroFL: the MultiStepLR factor at each of --heterofl_lr_milestones.',
                                   flag='heterofl_lr_decay')
  clip_norm: float = hyperparameter(1.0, 'HeteroFL: clip every local step\'s gradient to this global L2 norm before '
                                         'weight decay and momentum (its code\'s clip_grad_norm_(..., 1)); 0: none.',
                                    flag='heterofl_clip_norm')
  mask: bool = hyperparameter(True, 'HeteroFL: set the logits of classes a client does not hold to 0 in training.',
                              flag='heterofl_mask')
  static_bn: bool = hyperparameter(True, 'HeteroFL: score the global model with BatchNorm statistics from a pass over '
                                         'every client\'s training rows (its sBN); off: each test batch\'s own.',
                                   flag='heterofl_static_bn')
  split: str = hyperparameter('fix', "HeteroFL: 'fix', each client keeps its group's width rate (--models lists the "
                                     "rates); 'dynamic', each participant draws its rate anew every round from "
                                     "--heterofl_dynamic_rates (its code's model_split_mode='dynamic').",
                              flag='heterofl_split')
  dynamic_rates: str = hyperparameter('1,0.5,0.25,0.125,0.0625', 'HeteroFL: with --heterofl_split=dynamic, the '
                                      'width rates relative to the global model (--models, one architecture) that a '
                                      'participant draws from every round, with equal probability (its code\'s '
                                      'a-e, proportions a1-b1-c1-d1-e1).', flag='heterofl_dynamic_rates')

  def __post_init__(self):
    if not 0 <= self.momentum < 1 or self.weight_decay < 0:
      raise ConfigError(f'{setting(self, "momentum")} must be in [0, 1) and {setting(self, "weight_decay")} >= 0.')
    if not self.clip_norm >= 0:
      raise ConfigError(f'{setting(self, "clip_norm")} must be >= 0 (0: no clipping).')
    try:
      milestones = self.milestones
    except ValueError:
      milestones = None
    if milestones is None or any(m < 0 for m in milestones) or not 0 < self.lr_decay <= 1:
      raise ConfigError(f'{setting(self, "lr_milestones")} must list rounds >= 0 separated by commas (e.g. 150,250) '
                        f'and {setting(self, "lr_decay")} be in (0, 1].')
    if self.split not in ('fix', 'dynamic'):
      raise ConfigError(f'{setting(self, "split")} must be fix or dynamic.')
    try:
      rates = self.rates
    except ValueError:
      rates = ()
    if not rates or any(not 0 < r <= 1 for r in rates):
      raise ConfigError(f'{setting(self, "dynamic_rates")} must list rates in (0, 1] separated by commas (e.g. '
                        f'1,0.5,0.25).')

  @property
  def rates(self) -> tuple[float, ...]:
    """The rates of --heterofl_dynamic_rates."""
    return tuple(float(r) for r in self.dynamic_rates.replace(' ', '').split(',') if r)

  @property
  def milestones(self) -> tuple[int, ...]:
    """The rounds of --heterofl_lr_milestones."""
    return tuple(int(m) for m in self.lr_milestones.replace(' ', '').split(',') if m)


def local_optimizer(cfg: HeteroFLConfig, learning_rate: float) -> optax.GradientTransformation:
  """HeteroFL's local step (its `Local.train`): the loss's gradient clipped to global L2 norm `clip_norm`, then
  SGD's weight decay and momentum, as torch's SGD adds them after `clip_grad_norm_`."""
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm else optax.identity(),
                     optax.add_decayed_weights(cfg.weight_decay) if cfg.weight_decay else optax.identity(),
                     optax.sgd(learning_rate, momentum=cfg.momentum or None))


def sub_model(tree: Any, shapes: Any) -> Any:
  """The leading slice of every leaf of `tree` with the shape of the matching leaf of `shapes` (a sub-model's
  parameters from the global model's)."""
  return jax.tree.map(lambda a, s: a[tuple(slice(0, d) for d in s.shape)], tree, shapes)


def pad_to(tree: Any, shapes: Any) -> Any:
  """Every leaf zero-padded at the end of each axis to the shape of the matching leaf of `shapes`."""
  return jax.tree.map(lambda a, s: jnp.pad(a, [(0, t - d) for d, t in zip(a.shape, s.shape)]), tree, shapes)


def class_rows(tree: dict, label_mask: jnp.ndarray) -> dict:
  """Per-parameter weights [S, ...leaf] of the participants' entries: 1 everywhere except the head, whose class
  axis (the last) carries each participant's `label_mask` [S, C]."""
  ones = jax.tree.map(jnp.ones_like, tree)
  head = jax.tree.map(lambda a: jnp.broadcast_to(label_mask.reshape(label_mask.shape[:1] + (1,) * (a.ndim - 2)
                                                                    + label_mask.shape[1:]), a.shape),
                      tree['head'])
  return {**ones, 'head': head}


def combine(global_params: dict, uploads, masks: Any = None) -> dict:
  """HeteroFL's aggregation: each entry of the global model the unweighted mean of the participants' values of it
  (their sub-models' leading slices; the head's class rows only from participants holding the class), kept where
  no participant held it. `uploads`: per group `Uploads` of `HeteroFLUpload`s; under the dynamic split `masks`
  (`rate_masks`), whose entries of each upload's rate are those it holds."""
  total = jax.tree.map(jnp.zeros_like, global_params)
  count = jax.tree.map(jnp.zeros_like, global_params)
  for u in uploads:
    weights = class_rows(u.values.model, u.values.label_mask)
    if masks is not None:
      weights = jax.tree.map(jnp.multiply, weights, entries_held(masks, u.values.rate))
    real = lambda w: w * u.mask.astype(w.dtype).reshape((-1,) + (1,) * (w.ndim - 1))
    held = jax.tree.map(real, weights)
    total = jax.tree.map(jnp.add, total, pad_to(jax.tree.map(lambda w, v: (w * v).sum(0), held, u.values.model),
                                                global_params))
    count = jax.tree.map(jnp.add, count, pad_to(jax.tree.map(lambda w: w.sum(0), held), global_params))
  return jax.tree.map(lambda t, c, old: jnp.where(c > 0, t / jnp.maximum(c, 1.0), old), total, count, global_params)


def variables(group: GroupSpec, model=None) -> Any:
  """The shapes of a group's model's variables (of `model`, one of its group's models, where given)."""
  model = model or group.model
  return variable_shapes(model, group.input_shape)


def widest(group: GroupSpec) -> int:
  """The index of the group with the most parameters (the global model's architecture)."""
  sizes = [sum(leaf.size for leaf in jax.tree.leaves(variables(group, m)['params'])) for m in group.group_models]
  return max(range(len(sizes)), key=lambda i: sizes[i])


def check_sub_models(spec) -> int:
  """The widest group's index, after checking that every group's model is a leading slice of it (one architecture
  at several width rates) and that RM keeps the widths apart; a ConfigError naming the setting otherwise."""
  if spec.groups[0].rm not in ('none', 'fc'):
    raise ConfigError(f'ModelConfig.rm={spec.groups[0].rm!r}: HeteroFL slices every layer to its width, and '
                      f'{spec.groups[0].rm!r} pools each width\'s features to the same d, so a narrow model\'s '
                      f'features would not be the leading slice of the wide one\'s. Fix: ModelConfig.rm=\'none\' '
                      f'(HeteroFL: the head on the pooled features) or \'fc\'.')
  top = widest(spec.groups[0])
  big = variables(spec.groups[top])['params']
  for g in spec.groups:
    small = variables(g)['params']
    if (jax.tree.structure(small) != jax.tree.structure(big) or
            any(any(d > t for d, t in zip(a.shape, b.shape)) for a, b in zip(jax.tree.leaves(small),
                                                                              jax.tree.leaves(big)))):
      raise ConfigError(f'ModelConfig.names: HeteroFL needs one architecture at several width rates (e.g. '
                        f'resnet26@1,resnet26@0.5); {g.arch!r} is not a sub-model of {spec.groups[top].arch!r}.')
  return top


class HeteroFLServer(NamedTuple):
  """The server: model and state, the global model's params and BatchNorm statistics; round, the rounds done."""
  model: dict
  state: dict
  round: jnp.ndarray


class HeteroFLBroadcast(NamedTuple):
  """What a group's clients receive: model, the group's sub-model (the global model's leading slices); the global
  model (global_model, global_state) every client is scored with; lr_scale, the round's MultiStepLR factor."""
  model: dict
  global_model: dict
  global_state: dict
  lr_scale: jnp.ndarray


class LabelMask(NamedTuple):
  """A client's extra state: label_mask [C], 1 for the classes its training rows hold; rate, the index of the width
  rate it drew this round (the dynamic split; 0 under 'fix')."""
  label_mask: jnp.ndarray
  rate: jnp.ndarray = np.int32(0)  # NumPy: nothing may initialise a JAX backend on import (multi-process runs)


class HeteroFLUpload(NamedTuple):
  """A client's trained sub-model and its label mask; under the dynamic split, rate, the index of its drawn rate
  (its sub-model is the global model with the entries outside that rate's leading slices zero)."""
  model: dict
  label_mask: jnp.ndarray
  rate: Optional[jnp.ndarray] = None


def rate_masks(cfg: HeteroFLConfig, group: GroupSpec) -> Any:
  """Under the dynamic split: per rate of --heterofl_dynamic_rates, 1 on the entries of the global model (the
  group's, one architecture at one width) that the sub-model at that rate holds (its leading slices), stacked
  [rates, ...leaf]."""
  base, _, width = group.arch.partition('@')
  full = variables(group)['params']
  masks = []
  for r in cfg.rates:
    sub = variables(group, group.build_model(f'{base}@{float(width or 1) * r!r}'))['params']
    if jax.tree.structure(sub) != jax.tree.structure(full):
      raise ConfigError(f'HeteroFLConfig.dynamic_rates: {group.arch!r} at rate {r} is not a sub-model of it.')
    masks.append(jax.tree.map(lambda a, f: np.pad(np.ones(a.shape, np.float32),
                                                  [(0, t - d) for d, t in zip(a.shape, f.shape)]), sub, full))
  return jax.tree.map(lambda *m: np.stack(m), *masks)  # host constants (also when made inside a trace)


def entries_held(masks: Any, rate: jnp.ndarray) -> Any:
  """Each participant's rate mask [S, ...leaf] of its drawn rate indices `rate` [S]."""
  return jax.tree.map(lambda m: jnp.take(jnp.asarray(m), rate, axis=0), masks)


def client_program(cfg: HeteroFLConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """A client's round: its label mask from its rows, then its sub-model trained on CE with the logits of classes
  it lacks set to 0 (--heterofl_mask), at the round's rate (`local_optimizer`: the group's local rate,
  `LocalTraining.learning_rate`, scaled by the broadcast's MultiStepLR factor); it uploads the sub-model and the
  mask."""
  optimizer = lambda broadcast: local_optimizer(cfg, group.training.learning_rate * broadcast.lr_scale)

  def loss(client, batch, broadcast, key):
    logits, _, model_state = forward(group.model, client.params, client.model_state, batch.x, True, batch.mask)
    if cfg.mask:
      logits = jnp.where(client.extra.label_mask > 0, logits, 0.0)
    return cross_entropy(logits, batch.y, batch.mask), client._replace(model_state=model_state)

  dynamic = cfg.split == 'dynamic'
  masks = rate_masks(cfg, group) if dynamic else None

  def prepare(client, rows, broadcast, key):
    held = (jnp.arange(rows.x.shape[0]) < rows.num_train)[:, None] & (rows.y[:, None] == jnp.arange(num_classes))
    # the dynamic split: the round's rate drawn uniformly (its code's torch.multinomial over equal proportions)
    rate = jax.random.randint(key, (), 0, len(cfg.rates)) if dynamic else jnp.int32(0)
    return client._replace(extra=LabelMask(held.any(0).astype(jnp.float32), rate.astype(jnp.int32)))

  def receive(client, broadcast):
    if not dynamic:
      return client._replace(params=broadcast.model)
    # The sub-model as the global model with the entries outside its leading slices zero: every convolution's
    # dropped output channels and their BatchNorm's scale and bias are zero, so they stay zero through BatchNorm and
    # ReLU, the next layer reads nothing from them, and their gradients (and weight decay) are zero: the same
    # steps as the sliced sub-model's (tests/test_seed_baselines.py).
    held = jax.tree.map(lambda m: jnp.asarray(m)[client.extra.rate], masks)
    return client._replace(params=jax.tree.map(jnp.multiply, broadcast.model, held))

  def upload(client, rows, broadcast, key):
    return HeteroFLUpload(client.params, client.extra.label_mask, client.extra.rate if dynamic else None)

  program = sgd_program(loss, group.training, optimizer=optimizer, receive=receive, upload=upload)
  return program._replace(prepare=prepare)


def global_model_evaluation(cfg: HeteroFLConfig, group: GroupSpec) -> Evaluation:
  """Every client scored with the global model: under sBN with the BatchNorm statistics of a train-mode pass over
  every client's training rows (each chunk's batch statistics, weighted by its rows), else each test batch's."""
  model = group.group_models[widest(group)]
  if not (cfg.static_bn and 'batch_stats' in variables(group, model)):
    def prepare(client: ClientState, broadcast):
      return broadcast.global_model, broadcast.global_state

    def batch_logits(evaluated, x, rows):
      params, state = evaluated
      return (forward(model, params, state, x, True, rows)[0],)  # BatchNorm on the batch's real test rows
    return Evaluation(('global_model',), prepare, batch_logits, batch_rows=True)

  def prepare_static(client: ClientState, broadcast, sums: Optional[dict]):
    if sums is None:  # while the statistics are gathered: nothing to score with yet
      return broadcast.global_model, broadcast.global_state, None  # (a static marker: None, not gathered)
    stats = jax.tree.map(lambda a: a / jnp.maximum(sums['rows'], 1.0), sums['weighted'])
    return broadcast.global_model, {**broadcast.global_state, 'batch_stats': stats}, ()

  def statistics(evaluated, x, rows):
    params, state, _ = evaluated
    stats = batch_statistics(model, {'params': params, **state}, x, rows)
    k = rows.sum().astype(jnp.float32)
    return {'weighted': jax.tree.map(lambda a: jnp.where(k > 0, a * k, 0.0), stats), 'rows': k}

  def logits(evaluated, x):
    params, state, gathered = evaluated
    if gathered is None:
      raise ConfigError('HeteroFL\'s static BatchNorm scores the global model with statistics gathered over the '
                        'clients\' training rows, and this evaluation had none (Federation.evaluate gathers '
                        'them). Fix: score through Federation.evaluate, or --noheterofl_static_bn.')
    return (forward(model, params, state, x, False)[0],)
  return Evaluation(('global_model',), prepare_static, logits, statistics=statistics)


def heterofl(cfg: HeteroFLConfig, num_classes: int) -> Algorithm:
  """HeteroFL (fixed rates per group, or drawn every round: --heterofl_split) as an `Algorithm`."""
  dynamic = cfg.split == 'dynamic'
  masks = {}  # the dynamic split's rate masks, made once from the first group (every group is the global model)

  def masks_of(group):
    if 'masks' not in masks:
      masks['masks'] = rate_masks(cfg, group)
      masks['sizes'] = sum(m.reshape(m.shape[0], -1).sum(1) for m in jax.tree.leaves(masks['masks'])).astype(np.int64)
    return masks['masks']

  def init_server(key, spec, initial):
    top = check_sub_models(spec)
    if dynamic:
      if any(g.arch != spec.groups[top].arch for g in spec.groups):
        raise ConfigError(f'HeteroFLConfig.split=\'dynamic\' draws every client\'s rate from '
                          f'--heterofl_dynamic_rates={cfg.dynamic_rates} relative to one global model, and --models '
                          f'lists {", ".join(sorted({g.arch for g in spec.groups}))}. Fix: --models=ARCH (the global '
                          f'model, e.g. {spec.groups[top].arch}), or --heterofl_split=fix.')
      masks_of(spec.groups[0])
    return HeteroFLServer(initial[top].params, initial[top].model_state, jnp.zeros((), jnp.int32))

  def broadcast(server: HeteroFLServer, group) -> HeteroFLBroadcast:
    return HeteroFLBroadcast(sub_model(server.model, variables(group)['params']), server.model, server.state,
                             multistep_factor(server.round, cfg.milestones, cfg.lr_decay))

  def server_update(server, uploads, key):
    return server._replace(model=combine(server.model, uploads, masks.get('masks')), round=server.round + 1), {}

  if dynamic:  # what crosses is the drawn sub-model, not the global model's zeros around it
    traffic = Traffic(upload=lambda u: {'model': jnp.asarray(masks['sizes'])[u.rate],
                                        'label_mask': u.label_mask.size, 'rate': 1},
                      broadcast=lambda b: {}, received=lambda b, u: {'model': jnp.asarray(masks['sizes'])[u.rate]})
  else:
    traffic = Traffic(broadcast=lambda b: leaf_scalars({'model': b.model}))

  return one_phase('heterofl', init_server, lambda group: client_program(cfg, num_classes, group),
                   server_update, lambda group: global_model_evaluation(cfg, group), broadcast=broadcast,
                   init_client=lambda group, key: LabelMask(jnp.ones(num_classes)),
                   capabilities=Capabilities(partial_batches=True, shares_representations=False),
                   traffic=traffic,
                   upload_privacy=UploadPrivacy(public=('label_mask', 'rate'),
                                                reference=lambda b: {'model': b.model}))
