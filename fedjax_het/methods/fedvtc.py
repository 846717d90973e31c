"""FedVTC ("Bridging Generalization Gap of Heterogeneous Federated Clients Using Generative Models",
Sec. 3, Alg. 1, Eq. 2-6): class prototypes and standard deviations shared, a variational transposed-convolution decoder psi per client,
fine-tuning on its samples.

Each client's model is f = h o g with g ending in a learned map to R^p (--rm=fc, --feature_dim=p). Its per-client
state holds psi_k (`models.vtc.VTCDecoder`, identical initialisation on every client) and sigma_k in R^p.

Phase 'fl' (rounds 1..T, T = --rounds): a participant sets sigma_k <- sigma and, per local batch, takes
  an f-step:   f <- f - eta grad_f (CE + L_tc), psi and sigma frozen;
  a psi-step:  (psi, sigma) <- - eta grad L_tc, f frozen (recomputed with the updated g),
with v_i = z_i + sigma * eps_i (Sec. 3.2), x'_i = psi(v_i),
  L_rc,i = ||x'_i - x01_i||^2 summed over pixels (x01 = (x + 1) / 2: psi ends in a Sigmoid),
  KL_i   = 0.5 [ ||z_i - c^{y_i}||^2 + sum_j sigma_j^2 - p - sum_j log sigma_j^2 ]            (Eq. 3),
  L_e    = sum over classes y in the batch of mean_{i: y_i = y} (L_rc,i + KL_i)              (Eq. 4),
  L_dm   = sum over classes y in the batch of mean_{i: y_i = y} ||g(2 x'_i - 1) - c^y||^2    (Eq. 5),
  L_tc   = L_e + lambda L_dm                                                                  (Eq. 6).
It then uploads its class prototypes c_k^y (eval-mode means of g over ALL its training rows of class y), which
classes it holds, and sigma_k. The server averages each class's prototypes over the participants holding it
(unweighted; a class nobody held keeps its previous value) and sigma over all participants (unweighted).
Phase 'vtc_exchange' (round T+1, every client): each uploads psi_k (parameters and BatchNorm statistics, also a
  never-sampled client's initial one); the server averages all K.
Phase 'finetune' (round T+2, every client, no upload): each client draws S latents per class present from
  N(c^y, diag sigma^2), decodes them with the averaged psi in eval mode and fine-tunes its whole f with CE for
  --vtc_finetune_epochs epochs of --batch_size on these S*C samples (shuffled each epoch; the same samples every
  epoch). The run evaluates after round T+1 (before fine-tuning) and T+2 (after); summary.json's
  final_accuracy_by_phase holds both.

Choices where the paper is silent: one eps per batch, shared by its f-step and
psi-step; BatchNorm of g in train mode in both steps, its running statistics kept from the f-step's pass over the
real batch only; psi's from the psi-step only; plain SGD with rate --local_learning_rate for f, psi and sigma
(no state); sigma is trained as is (its sign never matters: only sigma^2 and sigma * eps enter); the fine-tuning
"rounds" of the paper read as epochs of minibatches; classes without a global prototype get no samples.
Ablations: --vtc_lambda=0 (L_e only, Table 4), --vtc_every_round (participants upload psi every round and start
from the average, Table 3 (2)); the run then has no 'vtc_exchange' round: fine-tuning decodes with the server's
last per-round average, which an exchange of every client's (stale, for most) local psi would replace.

Loss scale in the paper flag files: --vtc_loss_reduction=mean (below).

Loss scale (--vtc_loss_reduction, a library option; the default 'sum' is the paper's Eq. 3-5). Summed over 784
pixels and p = 980 dimensions, L_tc outweighs the batch-mean CE by two orders of magnitude, and its KL term pulls
every z towards the prototypes, which start at 0. On mnist5k (docs/methods/fedvtc.md, `python
benchmarks/fedvtc_loss_scale.py`) a client trained with L_tc summed stays near chance at every rate tried (z
collapses), while with 'mean' (L_rc / pixels, KL / p, L_dm / p, what `F.mse_loss` gives in PyTorch) it trains as
well as CE alone. The paper publishes no code, so which reduction its numbers came from is unknown; since only
'mean' trains at the paper's rates (1e-4 MNIST, 1e-2 the others), the Table 1 flag files use it. The default stays 'sum', Eq. 3-5 as printed.

Communication (scalars; bytes are 4 per scalar): per participant per round up p per class held (prototypes) + p
(sigma), down p per class it holds that has a global prototype (|Y_k| p: the server sends c^y to holders of y)
+ p; at the end every client uploads psi (parameters and
BatchNorm statistics) and receives it back with the prototypes and sigma.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple
import math

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import (Algorithm, Batch, ClientProgram, ClientRows, GroupSpec, Phase, Traffic, hyperparameter,
                             leaf_scalars, single_stage)
from fedjax_het.errors import ConfigError, setting
from fedjax_het.methods.shared.base import keep_server, local_head_evaluation
from fedjax_het.methods.shared.common import class_prototypes, cross_entropy, descend
from fedjax_het.models.forward import forward
from fedjax_het.models.vtc import VTCDecoder, init_vtc
from fedjax_het.uploads import masked_mean


@dataclasses.dataclass(frozen=True)
class FedVTCConfig:
  """FedVTC's hyperparameters (ICLR Sec. 4.1, Table 5)."""
  vtc_lambda: float = hyperparameter(0.1, 'FedVTC: weight lambda of the distribution-matching loss L_dm (Eq. 6); '
                                          '0 trains on L_e only (Table 4).')
  samples_per_class: int = hyperparameter(500, 'FedVTC: latents S drawn per class for fine-tuning (ICLR Sec. 4.1: '
                                               '500 MNIST, CIFAR-10; 1000 CIFAR-100, TinyImageNet).',
                                          flag='vtc_samples_per_class')
  finetune_epochs: int = hyperparameter(5, 'FedVTC: epochs of fine-tuning on the generated samples.',
                                        flag='vtc_finetune_epochs')
  every_round: bool = hyperparameter(False, 'FedVTC: participants upload psi every round and start from the '
                                            'server\'s average (Table 3 (2)).', flag='vtc_every_round')
  sigma_init: float = hyperparameter(1.0, 'FedVTC: initial standard deviations sigma (Table 5).',
                                     flag='vtc_sigma_init')
  loss_reduction: str = hyperparameter('sum', "FedVTC: 'sum' takes Eq. 3-5 as written (L_rc summed over pixels, KL "
                                              "and L_dm over the p latent dimensions); 'mean' averages each over its "
                                              "pixels or dimensions (PyTorch's default mse_loss reduction). Not in "
                                              "the paper: see the module docstring.", flag='vtc_loss_reduction')

  def __post_init__(self):
    if self.vtc_lambda < 0:
      raise ConfigError(f'{setting(self, "vtc_lambda")} must be >= 0.')
    if self.samples_per_class < 1 or self.finetune_epochs < 0:
      raise ConfigError(f'{setting(self, "samples_per_class")} must be >= 1 and '
                        f'{setting(self, "finetune_epochs")} >= 0.')
    if not self.sigma_init > 0:
      raise ConfigError(f'{setting(self, "sigma_init")} must be > 0.')
    if self.loss_reduction not in ('sum', 'mean'):
      raise ConfigError(f"{setting(self, 'loss_reduction')}: choose 'sum' (the paper's equations) or "
                        f"'mean'.")


def kl_to_prototype(z: jnp.ndarray, protos: jnp.ndarray, sigma: jnp.ndarray) -> jnp.ndarray:
  """Eq. 3 per row: 0.5 [ ||z_i - c_i||^2 + sum_j sigma_j^2 - p - sum_j log sigma_j^2 ] for z, protos [B, p]."""
  p = z.shape[-1]
  return 0.5 * (jnp.sum((z - protos) ** 2, -1) + jnp.sum(sigma ** 2) - p - jnp.sum(jnp.log(sigma ** 2)))


def sum_of_class_means(values: jnp.ndarray, labels: jnp.ndarray, num_classes: int) -> jnp.ndarray:
  """sum over the classes present in the batch of the mean of `values` [B] over that class's rows (Eq. 4-5: the
  paper's per-class means over D_k^y taken over the batch)."""
  onehot = jax.nn.one_hot(labels, num_classes, dtype=values.dtype)
  sums, counts = onehot.T @ values, onehot.sum(0)
  return jnp.sum(jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0))


def reconstruction_error(decoded: jnp.ndarray, x: jnp.ndarray) -> jnp.ndarray:
  """L_rc per row: the summed squared pixel error between psi's output in [0, 1] and the image x in [-1, 1]."""
  return jnp.sum((decoded - (x + 1.0) / 2.0) ** 2, axis=tuple(range(1, x.ndim)))


def vtc_terms(model, decoder: VTCDecoder, num_classes: int):
  """(f_params, model_state, psi, sigma, x, y, protos, eps) -> (CE, L_rc, KL, L_dm, (model_state after the real
  batch, psi's updated BatchNorm statistics)): every term of one FedVTC step (Eq. 2-5), each summed over the
  classes present of its class mean, g and psi in train mode."""
  def terms(f_params, model_state, psi, sigma, x, y, protos, eps):
    logits, z, new_state = forward(model, f_params, model_state, x, True)
    c = protos[y]
    decoded, psi_state = decoder.apply(psi, z + sigma * eps, True, mutable=['batch_stats'])
    l_rc = sum_of_class_means(reconstruction_error(decoded, x), y, num_classes)
    kl = sum_of_class_means(kl_to_prototype(z, c, sigma), y, num_classes)
    _, z_decoded, _ = forward(model, f_params, model_state, 2.0 * decoded - 1.0, True)
    l_dm = sum_of_class_means(jnp.sum((z_decoded - c) ** 2, -1), y, num_classes)
    return cross_entropy(logits, y), l_rc, kl, l_dm, (new_state, psi_state['batch_stats'])
  return terms


def vtc_objective(model, decoder: VTCDecoder, num_classes: int, lamda: float, reduction: str = 'sum'):
  """(f_params, model_state, psi, sigma, x, y, protos, eps) -> (CE, L_tc, aux) with L_tc = L_rc + KL + lambda L_dm
  (Eq. 4-6); reduction 'mean' divides L_rc by the pixels per image and KL and L_dm by p."""
  terms = vtc_terms(model, decoder, num_classes)

  def objective(f_params, model_state, psi, sigma, x, y, protos, eps):
    ce, l_rc, kl, l_dm, aux = terms(f_params, model_state, psi, sigma, x, y, protos, eps)
    if reduction == 'mean':
      l_rc, kl, l_dm = l_rc / math.prod(x.shape[1:]), kl / protos.shape[-1], l_dm / protos.shape[-1]
    return ce, l_rc + kl + lamda * l_dm, aux
  return objective


def vtc_steps(model, decoder: VTCDecoder, num_classes: int, lamda: float, optimizer: optax.GradientTransformation,
              reduction: str = 'sum'):
  """(f_step, psi_step), each (client, x, y, protos, eps) -> (client, loss): the two updates of a FedVTC batch
  (Alg. 1 lines 11-14). f_step: f <- f - eta grad_f (CE + L_tc) with psi and sigma constants; it keeps g's
  BatchNorm statistics of the pass over the real batch. psi_step: (psi, sigma) <- (psi, sigma) - eta grad L_tc
  with f a constant; it keeps psi's BatchNorm statistics."""
  objective = vtc_objective(model, decoder, num_classes, lamda, reduction)

  def f_step(client, x, y, protos, eps):
    psi, sigma = client.extra.psi, client.extra.sigma

    def loss(f_params):
      ce, tc, aux = objective(f_params, client.model_state, psi, sigma, x, y, protos, eps)
      return ce + tc, aux
    (value, (model_state, _)), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    return client._replace(params=descend(optimizer, client.params, grads), model_state=model_state), value

  def psi_step(client, x, y, protos, eps):
    psi = client.extra.psi

    def loss(trained):
      _, tc, aux = objective(client.params, client.model_state, {**psi, 'params': trained[0]}, trained[1], x, y,
                             protos, eps)
      return tc, aux
    (value, (_, psi_stats)), grads = jax.value_and_grad(loss, has_aux=True)((psi['params'], client.extra.sigma))
    psi_params, sigma = descend(optimizer, (psi['params'], client.extra.sigma), grads)
    return client._replace(extra=VTCClient({'params': psi_params, 'batch_stats': psi_stats}, sigma)), value
  return f_step, psi_step


class VTCClient(NamedTuple):
  """A client's extra state: its decoder psi_k's variables and its SDs sigma_k [p]."""
  psi: dict
  sigma: jnp.ndarray


class FedVTCServer(NamedTuple):
  """The server: protos [C, p] and present [C], the global prototypes; sigma [p]; psi, the averaged decoder."""
  protos: jnp.ndarray
  present: jnp.ndarray
  sigma: jnp.ndarray
  psi: dict


class VTCMessage(NamedTuple):
  """What a group's clients receive (None where a phase does not send it): 'fl', the prototypes, which classes have
  one and sigma (psi too under --vtc_every_round); 'vtc_exchange', nothing; 'finetune', all four."""
  protos: Any = None
  present: Any = None
  sigma: Any = None
  psi: Any = None


class VTCUpload(NamedTuple):
  """A client's upload: 'fl', its class prototypes [C, p], counts [C] and sigma_k (psi_k too under
  --vtc_every_round); 'vtc_exchange', psi_k alone; None where not sent."""
  protos: Any = None
  counts: Any = None
  sigma: Any = None
  psi: Any = None


def decode_latents(decoder: VTCDecoder, psi: dict, protos: jnp.ndarray, sigma: jnp.ndarray, labels: jnp.ndarray,
                   eps: jnp.ndarray) -> jnp.ndarray:
  """Images in [-1, 1] decoded (psi in eval mode) from latents c^y + sigma * eps ~ N(c^y, diag sigma^2)."""
  return 2.0 * decoder.apply(psi, protos[labels] + sigma * eps, False) - 1.0


def row_normals(key: jax.Array, rows: jnp.ndarray, p: int) -> jnp.ndarray:
  """One N(0, I_p) draw per row id, from fold_in(key, row): the same row gets the same draw in every epoch."""
  return jax.vmap(lambda r: jax.random.normal(jax.random.fold_in(key, r), (p,)))(rows)


def finetune_latents(key: jax.Array, rows: jnp.ndarray, samples_per_class: int, protos: jnp.ndarray,
                     sigma: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
  """(latents [B, p], labels [B]) of generated fine-tuning rows `rows` (Alg. 1 lines 25-28): row r has label
  r // S and latent c^y + sigma * eps_r ~ N(c^y, diag sigma^2), eps_r the row's own draw (`row_normals`)."""
  labels = rows // samples_per_class
  return protos[labels] + sigma * row_normals(key, rows, protos.shape[-1]), labels


def vtc_decoder(group: GroupSpec) -> VTCDecoder:
  """The group's decoder psi: transposed convolutions from the latent width p (--feature_dim) to its images."""
  if group.rm != 'fc':
    raise ConfigError(f'FedVTC: g must end in a learned map to the latent width p (the paper\'s Linear(L, p)). '
                      f'Fix: ModelConfig.rm=\'fc\' (now {group.rm!r}).')
  return VTCDecoder(tuple(group.input_shape), group.feature_dim, group.conv)


def init_client_extra(cfg: FedVTCConfig, group: GroupSpec, key: jax.Array) -> VTCClient:
  """A client's psi_k (the same initialisation on every client) and sigma_k = --vtc_sigma_init."""
  return VTCClient(init_vtc(vtc_decoder(group), group.shared_key('fedvtc_psi')),
                   jnp.full(group.feature_dim, cfg.sigma_init, jnp.float32))


def init_server(num_classes: int, key: jax.Array, spec, initial) -> FedVTCServer:
  """Prototypes 0 (no class present yet), and the clients' initial sigma and psi."""
  return FedVTCServer(jnp.zeros((num_classes, spec.feature_dim)), jnp.zeros(num_classes, bool),
                      initial[0].extra.sigma, initial[0].extra.psi)


# ---------------------------------------------------------------- phase 'fl'
def fl_broadcast(cfg: FedVTCConfig, server: FedVTCServer, group) -> VTCMessage:
  """The global prototypes, which classes have one, sigma; psi too under --vtc_every_round."""
  return VTCMessage(server.protos, server.present, server.sigma, server.psi if cfg.every_round else None)


def fl_client(cfg: FedVTCConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """sigma_k <- sigma (psi_k <- psi under --vtc_every_round); per batch an f-step then a psi-step (Alg. 1 lines
  11-14); then the class prototypes of all training rows, which classes it holds and sigma_k (psi_k too)."""
  f_step, psi_step = vtc_steps(group.model, vtc_decoder(group), num_classes, cfg.vtc_lambda,
                               group.training.optimizer(), cfg.loss_reduction)

  def init(client, broadcast, key):
    psi = broadcast.psi if cfg.every_round else client.extra.psi
    return client._replace(extra=VTCClient(psi, broadcast.sigma))

  def step(client, batch: Batch, broadcast, key):
    args = (batch.x, batch.y, broadcast.protos, jax.random.normal(key, (batch.x.shape[0], group.feature_dim)))
    client, loss = f_step(client, *args)
    return psi_step(client, *args)[0], loss

  def final(client, rows: ClientRows, broadcast, key):
    protos, counts = class_prototypes(rows.reps, rows.y, jnp.arange(rows.y.shape[0]) < rows.num_train,
                                      num_classes)
    return client, VTCUpload(protos, counts, client.extra.sigma, client.extra.psi if cfg.every_round else None)
  return ClientProgram(init, single_stage(step, group.training), final, group.training,
                       trained=lambda client: client)


def fl_server(cfg: FedVTCConfig, server: FedVTCServer, uploads, key) -> tuple[FedVTCServer, dict]:
  """Each class's prototype averaged over the participants holding it (a class nobody held keeps its value),
  sigma (and psi under --vtc_every_round) over all participants, unweighted."""
  protos, present = uploads.class_mean('protos')
  new = FedVTCServer(jnp.where(present[:, None], protos, server.protos), present | server.present,
                     uploads.mean('sigma', previous=server.sigma),
                     uploads.mean('psi', previous=server.psi) if cfg.every_round else server.psi)
  return new, {'global_classes': new.present.sum(), 'sigma_rms': jnp.sqrt(jnp.mean(new.sigma ** 2))}


# ---------------------------------------------------------------- phase 'vtc_exchange'
def exchange_client(group: GroupSpec) -> ClientProgram:
  """No training; uploads psi_k."""
  return ClientProgram(lambda client, broadcast, key: client, (),
                       lambda client, rows, broadcast, key: (client, VTCUpload(psi=client.extra.psi)), group.training)


def exchange_server(server: FedVTCServer, uploads, key) -> tuple[FedVTCServer, dict]:
  """psi <- the average of every client's psi_k."""
  return server._replace(psi=uploads.mean('psi', previous=server.psi)), {}


# ---------------------------------------------------------------- phase 'finetune'
def finetune_broadcast(server: FedVTCServer, group) -> VTCMessage:
  """Everything the server holds: prototypes, which classes have one, sigma, the averaged psi."""
  return VTCMessage(*server)


def finetune_client(cfg: FedVTCConfig, num_classes: int, group: GroupSpec) -> ClientProgram:
  """CE of the whole f on S * C rows decoded by the averaged psi (Alg. 1 lines 25-28) for --vtc_finetune_epochs
  epochs of --batch_size; rows of classes without a global prototype weigh 0; nothing uploaded."""
  decoder = vtc_decoder(group)
  S = cfg.samples_per_class
  training = dataclasses.replace(group.training, epochs=cfg.finetune_epochs, order='shuffle', rows=S * num_classes,
                                 max_steps=None, drop_last=True)
  optimizer = training.optimizer()

  def init(client, broadcast, key):
    return client, key  # the key of this client's samples: the same rows in every epoch

  def step(carry, batch: Batch, broadcast, key):
    client, sample_key = carry
    latents, labels = finetune_latents(sample_key, batch.index, S, broadcast.protos, broadcast.sigma)
    x = 2.0 * decoder.apply(broadcast.psi, latents, False) - 1.0
    weight = broadcast.present[labels]  # classes without a global prototype get no samples

    def loss(f_params):
      logits, _, model_state = forward(group.model, f_params, client.model_state, x, True)
      per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return masked_mean(per_row, weight), model_state
    (value, model_state), grads = jax.value_and_grad(loss, has_aux=True)(client.params)
    return (client._replace(params=descend(optimizer, client.params, grads), model_state=model_state),
            sample_key), value

  return ClientProgram(init, single_stage(step, training), lambda carry, rows, broadcast, key: (carry[0], VTCUpload()),
                       training)


# ---------------------------------------------------------------- traffic and samples
def sent_scalars(tree) -> dict:
  """Scalars of an upload (`VTCUpload`) or broadcast (`VTCMessage`): p per class held (prototypes), sigma's p,
  psi's parameters and statistics, where sent."""
  out = {}
  if tree.protos is not None:
    held = tree.counts > 0 if isinstance(tree, VTCUpload) else tree.present
    out['prototypes'] = jnp.sum(held) * tree.protos.shape[-1]
    out['sigma'] = tree.sigma.size
  if tree.psi is not None:
    out['psi'] = sum(leaf_scalars(tree.psi).values())
  return out


def received_scalars(broadcast: VTCMessage, upload: VTCUpload) -> dict:
  """A participant of the 'fl' phase receives the global prototypes of the classes it holds (|Y_k| p: the paper
  sends c^y only to holders of y), sigma, and psi in the per-round ablation; other phases as broadcast."""
  if broadcast.protos is None or upload.counts is None:
    return sent_scalars(broadcast)
  out = {'prototypes': jnp.sum((upload.counts > 0) & broadcast.present) * broadcast.protos.shape[-1],
         'sigma': broadcast.sigma.size}
  if broadcast.psi is not None:
    out['psi'] = sum(leaf_scalars(broadcast.psi).values())
  return out


def decoded_samples(num_classes: int, server: FedVTCServer, spec, key: jax.Array, n: int) -> jnp.ndarray:
  """[C, n, H, W, c]: n images per class decoded by the server's psi (the averaged one after 'vtc_exchange');
  black for classes without a global prototype."""
  labels = jnp.repeat(jnp.arange(num_classes), n)
  eps = jax.random.normal(key, (num_classes * n, spec.feature_dim))
  images = decode_latents(vtc_decoder(spec.groups[0]), server.psi, server.protos, server.sigma, labels, eps)
  images = jnp.where(server.present[labels][:, None, None, None], images, -1.0)
  return images.reshape((num_classes, n) + images.shape[1:])


def fedvtc(cfg: FedVTCConfig, num_classes: int, rounds: int) -> Algorithm:
  """FedVTC as an `Algorithm` of three phases: 'fl' (`rounds` rounds), 'vtc_exchange' and 'finetune' (one round
  each, every client); under --vtc_every_round psi is already the server's per-round average, and no stale local
  decoders replace it in an exchange."""
  traffic = Traffic(sent_scalars, sent_scalars, received_scalars)
  fl = Phase('fl', functools.partial(fl_client, cfg, num_classes), functools.partial(fl_server, cfg),
             functools.partial(fl_broadcast, cfg), rounds=rounds, traffic=traffic)
  exchange = Phase('vtc_exchange', exchange_client, exchange_server, lambda server, group: VTCMessage(), rounds=1,
                   join_ratio=1.0, traffic=traffic)
  finetune = Phase('finetune', functools.partial(finetune_client, cfg, num_classes), keep_server,
                   finetune_broadcast, rounds=1, join_ratio=1.0, traffic=traffic)
  phases = (fl, finetune) if cfg.every_round else (fl, exchange, finetune)
  return Algorithm('fedvtc', functools.partial(init_server, num_classes), phases, local_head_evaluation,
                   init_client=functools.partial(init_client_extra, cfg),
                   samples=functools.partial(decoded_samples, num_classes))
