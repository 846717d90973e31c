"""Representation inversion: how much of a client's images an attacker recovers from what a method uploads
(fedre.txt Sec. 4, Q2, Figure 4 and Appendix C.1; the attack of its ref. [35], deep image prior).

Threat model (the paper's): the attacker holds the client's extractor, RM(g(.)) in eval mode (white box), and one
uploaded d-vector t. It optimises an image x from noise so that RM(g(x)) matches t (`invert`):

    min_x  ||RM(g(x)) - t||^2 / ||t||^2  +  tv_weight * TV(x),     x = tanh(z) in [-1, 1]   ('pixel' prior)
                                                                   x = DIP_theta(noise)     ('dip' prior)

with Adam for `steps` steps. The representation error is divided by ||t||^2 so that one --tv_weight fits every
width d and scale of representation; TV is the mean absolute difference of neighbouring pixels (anisotropic total
variation). The deep-image-prior option (Ulyanov et al. 2018, the paper's ref. [35]) optimises the weights theta of
a small randomly initialised convolutional net whose output, from a fixed noise input, is the image. Targets are
independent problems: one jitted function vmaps the attack over a batch of them, each keyed by its own index, so a
target's reconstruction does not depend on which others share its batch or on padding (`invert_padded`).

Leakage, PSNR and MSE on the 0-255 scale (images mapped (x + 1) / 2 * 255, as the paper reports), measured three
ways so that an uninformative image cannot win:
  reference (`reference_images`): against the one image the upload describes, fixed before the attack: for a
    representation its own sample; for a prototype of class c the mean image of the client's class-c samples; for
    an entangled representation sum_c w_c (mean image of class c), the weights w_c its soft label reveals (Eq. 2:
    the same weights that mix the class prototypes);
  best match (`leakage`, the attacker-favourable measure): against the most similar (lowest MSE) original the upload
    could have come from (`candidate_mask`: the sample; any sample of the class; any sample of the client). On
    MNIST this favours any blob: a black image finds some dark digit among hundreds;
  null baseline (`NULL_IMAGE`, all black, the digits' background): the same two scores of an image that knows
    nothing; the table reports each score's gain over it, the leakage a null image cannot win;
  identification (`identified`): whether a reconstruction is nearer (MSE) to its own reference than to every other
    target's reference of the same run (chance: 1 / targets).
PSNR is capped at `PSNR_MAX` dB (an exact reconstruction). SSIM is not reported: no well-kept SSIM library is
installed with this package (dm-pix / scikit-image would provide one).

Prototype targets are the classes with the most samples (at least --min_class_samples) and must come from the model
the attacker inverts through: FedGH, FedTGP, CCVR and FedVTC upload eval-mode prototypes of the trained extractor;
FedProto's are gathered during its training passes (train mode, a model that moves every step), so an attack on them
through the final extractor mixes two models (the comparison in docs/ uses FedGH).

What is attacked (`round_uploads`): the method's own client program run for one round, from a federation state,
on the chosen clients, exactly as `Federation.round` runs it (the same executor, broadcast and per-client keys, so
a client's upload is the one it sends in that round of the full run); the engine does not hand out a round's
uploads, so this module repeats the few lines of `Federation.round` that produce them, without the server step.
Each client's upload is turned into targets by `upload_targets`: FedAllRep ('rep' of every training row:
representations), FedRE ('rep', one row: an entangled representation), FedProto / FedGH / FedTGP / FPL / FedVTC
('protos' of the classes held: prototypes) and CCVR ('means' of the classes held: prototypes).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_het.algorithms.common import class_prototypes
from fedjax_het.errors import ConfigError

PRIORS = ('pixel', 'dip')
KINDS = ('representation', 'prototype', 'entangled')
PSNR_MAX = 100.0  # dB, reported for an exact reconstruction (MSE 0)
NULL_IMAGE = -1.0  # the null reconstruction: every pixel black (0 on the 0-255 scale)


@dataclasses.dataclass(frozen=True)
class InversionConfig:
  """The attack's settings (each a flag of experiments/invert.py, named in its error).

  steps: Adam steps (--inversion_steps); learning_rate: Adam's rate (--inversion_lr); tv_weight: weight of the
  total-variation prior (--tv_weight); prior: 'pixel' (optimise the image through tanh) or 'dip' (optimise a deep
  image prior's weights) (--prior); dip_channels: the DIP net's width (--dip_channels); init_scale: std of the
  initial noise (pixel prior: of z; DIP: of its fixed input).
  """
  steps: int = 500
  learning_rate: float = 0.01
  tv_weight: float = 0.1
  prior: str = 'dip'
  dip_channels: int = 16
  init_scale: float = 0.1

  def __post_init__(self):
    if self.steps < 1:
      raise ConfigError(f'--inversion_steps={self.steps} must be >= 1.')
    if not (np.isfinite(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f'--inversion_lr={self.learning_rate} must be a finite number > 0.')
    if not (np.isfinite(self.tv_weight) and self.tv_weight >= 0):
      raise ConfigError(f'--tv_weight={self.tv_weight} must be a finite number >= 0.')
    if self.prior not in PRIORS:
      raise ConfigError(f'--prior={self.prior!r} is unknown; choose one of {", ".join(PRIORS)}.')
    if self.dip_channels < 1:
      raise ConfigError(f'--dip_channels={self.dip_channels} must be >= 1.')
    if not self.init_scale > 0:
      raise ConfigError(f'init_scale={self.init_scale} must be > 0.')


# ---------------------------------------------------------------------------------------------------- metrics
def to_255(x: jnp.ndarray) -> jnp.ndarray:
  """Images in [-1, 1] on the paper's 0-255 scale: (x + 1) / 2 * 255."""
  return (jnp.asarray(x, jnp.float32) + 1.0) * 127.5


def mse_255(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """Per-image mean squared error on the 0-255 scale of images a, b [..., H, W, C] in [-1, 1] -> [...]
  (the paper's MSE, Sec. 4 'Evaluation Metrics')."""
  return jnp.mean((to_255(a) - to_255(b)) ** 2, axis=(-3, -2, -1))


def psnr_from_mse(mse: jnp.ndarray) -> jnp.ndarray:
  """PSNR = 10 log10(255^2 / MSE) in dB (the paper's ref. [29]), capped at `PSNR_MAX` (MSE 0)."""
  floor = 255.0 ** 2 * 10.0 ** (-PSNR_MAX / 10.0)
  return 10.0 * jnp.log10(255.0 ** 2 / jnp.maximum(mse, floor))


def psnr_255(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  """Per-image PSNR on the 0-255 scale of images a, b [..., H, W, C] in [-1, 1] -> [...]."""
  return psnr_from_mse(mse_255(a, b))


def total_variation(x: jnp.ndarray) -> jnp.ndarray:
  """Anisotropic total variation of one image x [H, W, C]: the mean absolute difference of vertically and of
  horizontally neighbouring pixels, summed."""
  return jnp.mean(jnp.abs(x[1:] - x[:-1])) + jnp.mean(jnp.abs(x[:, 1:] - x[:, :-1]))


def candidate_mask(kind: str, y: jnp.ndarray, valid: jnp.ndarray, rows: jnp.ndarray, labels: jnp.ndarray
                   ) -> jnp.ndarray:
  """Which of a client's training rows [N] each target [T] could have come from -> bool [T, N] (module docstring).

  kind 'representation': row rows[t] only; 'prototype': the valid rows of class labels[t]; 'entangled': every
  valid row. y [N]: the rows' labels; valid [N]: the real rows.
  """
  valid = jnp.asarray(valid, bool)
  n = y.shape[0]
  if kind == 'representation':
    return (jnp.arange(n)[None, :] == jnp.asarray(rows)[:, None]) & valid[None, :]
  if kind == 'prototype':
    return (jnp.asarray(y)[None, :] == jnp.asarray(labels)[:, None]) & valid[None, :]
  if kind == 'entangled':
    return jnp.broadcast_to(valid[None, :], (len(labels), n))
  raise ConfigError(f'upload kind {kind!r} is unknown; choose one of {", ".join(KINDS)}.')


def leakage(reconstructions: jnp.ndarray, originals: jnp.ndarray, allowed: jnp.ndarray) -> dict:
  """PSNR and MSE (0-255 scale) of each reconstruction [T, H, W, C] against its best-matching original among the
  rows `allowed` [T, N] of originals [N, H, W, C] (lowest MSE; the attacker-favourable measure of Q2).

  Returns {'psnr': [T], 'mse': [T], 'match': [T] index of the matched original}; a target with no allowed row
  gets MSE inf, PSNR -inf and match -1.
  """
  mse = jax.vmap(lambda r: mse_255(r[None], originals))(jnp.asarray(reconstructions, jnp.float32))  # [T, N]
  mse = jnp.where(allowed, mse, jnp.inf)
  match = jnp.argmin(mse, axis=1)
  best = jnp.take_along_axis(mse, match[:, None], axis=1)[:, 0]
  has = jnp.any(allowed, axis=1)
  return {'psnr': jnp.where(has, psnr_from_mse(best), -jnp.inf), 'mse': best, 'match': jnp.where(has, match, -1)}


def class_mean_images(x: jnp.ndarray, y: jnp.ndarray, valid: jnp.ndarray, num_classes: int) -> jnp.ndarray:
  """The mean image of each class over a client's valid rows: [C, H, W, c] (zeros for classes it lacks)."""
  x = jnp.asarray(x, jnp.float32)
  means, _ = class_prototypes(x.reshape(x.shape[0], -1), jnp.asarray(y), jnp.asarray(valid, bool), num_classes)
  return means.reshape((num_classes,) + x.shape[1:])


def reference_images(kind: str, weights: jnp.ndarray, rows: jnp.ndarray, x: jnp.ndarray, y: jnp.ndarray,
                     valid: jnp.ndarray) -> jnp.ndarray:
  """The image each target [T] describes (module docstring), [T, H, W, c]: a representation's own sample x[row];
  otherwise sum_c weights[t, c] (mean image of class c), weights [T, C] the target's class weights (one-hot for a
  prototype, the soft label of an entangled representation)."""
  if kind == 'representation':
    return jnp.asarray(x)[jnp.asarray(rows)]
  if kind not in KINDS:
    raise ConfigError(f'upload kind {kind!r} is unknown; choose one of {", ".join(KINDS)}.')
  means = class_mean_images(x, y, valid, weights.shape[-1])
  return jnp.tensordot(jnp.asarray(weights, jnp.float32), means, axes=(1, 0))


def identified(reconstructions: jnp.ndarray, references: jnp.ndarray) -> jnp.ndarray:
  """bool [T]: reconstruction t is nearer (MSE) to reference t than to every other reference (ties count as
  misses); the rate's chance level is 1 / T."""
  mse = jax.vmap(lambda r: mse_255(r[None], references))(jnp.asarray(reconstructions, jnp.float32))  # [T, T]
  own = jnp.diagonal(mse)
  others = jnp.where(jnp.eye(mse.shape[0], dtype=bool), jnp.inf, mse)
  return own < others.min(axis=1)


# ---------------------------------------------------------------------------------------------------- attack
class DeepImagePrior(nn.Module):
  """A small conv net (3x3 conv - ReLU twice, then 3x3 conv - tanh) mapping a fixed noise image to an image in
  [-1, 1]: the deep image prior (Ulyanov et al. 2018) whose weights the attack optimises instead of pixels."""
  channels: int
  out_channels: int

  @nn.compact
  def __call__(self, z: jnp.ndarray) -> jnp.ndarray:
    h = nn.relu(nn.Conv(self.channels, (3, 3))(z))
    h = nn.relu(nn.Conv(self.channels, (3, 3))(h))
    return jnp.tanh(nn.Conv(self.out_channels, (3, 3))(h))


def image_parameterisation(image_shape: Sequence[int], cfg: InversionConfig
                           ) -> tuple[Callable[[jax.Array], Any], Callable[[Any], jnp.ndarray]]:
  """(init(key) -> variables, render(variables) -> image [H, W, C] in [-1, 1]) of the prior: 'pixel', z ~
  N(0, init_scale^2) per pixel and x = tanh(z); 'dip', a `DeepImagePrior` and its fixed noise input."""
  shape = tuple(image_shape)
  if cfg.prior == 'pixel':
    return (lambda key: cfg.init_scale * jax.random.normal(key, shape)), jnp.tanh
  net = DeepImagePrior(cfg.dip_channels, shape[-1])

  def init(key):
    noise_key, net_key = jax.random.split(key)
    z = cfg.init_scale * jax.random.normal(noise_key, shape[:-1] + (cfg.dip_channels,))
    return {'z': z, 'theta': net.init(net_key, z[None])['params']}

  def render(v):
    return net.apply({'params': v['theta']}, jax.lax.stop_gradient(v['z'])[None])[0]
  return init, render


def inversion_loss(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], image: jnp.ndarray, target: jnp.ndarray,
                   tv_weight: float) -> jnp.ndarray:
  """||rep_fn(x) - t||^2 / ||t||^2 + tv_weight * TV(x) for one image x [H, W, C] and target t [d]; rep_fn maps a
  batch [B, H, W, C] to [B, d]."""
  rep = rep_fn(image[None])[0]
  scale = jnp.maximum(jnp.sum(target ** 2), 1e-12)
  return jnp.sum((rep - target) ** 2) / scale + tv_weight * total_variation(image)


def invert_one(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], target: jnp.ndarray, image_shape: Sequence[int],
               cfg: InversionConfig, key: jax.Array) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The attack on one target [d] (module docstring): (image [H, W, C] in [-1, 1], its final representation loss
  ||rep(x) - t||^2 / ||t||^2). Adam over cfg.steps steps in a lax.scan; pure, so it jits and vmaps."""
  init, render = image_parameterisation(image_shape, cfg)
  opt = optax.adam(cfg.learning_rate)
  variables = init(key)
  loss = lambda v: inversion_loss(rep_fn, render(v), target, cfg.tv_weight)

  def step(carry, _):
    v, state = carry
    grads = jax.grad(loss)(v)
    updates, state = opt.update(grads, state, v)
    return (optax.apply_updates(v, updates), state), None

  (variables, _), _ = jax.lax.scan(step, (variables, opt.init(variables)), None, length=cfg.steps)
  image = render(variables)
  return image, inversion_loss(rep_fn, image, target, 0.0)


def target_keys(key: jax.Array, index: jnp.ndarray) -> jax.Array:
  """Each target's key, fold_in(key, its index): a target's noise does not depend on its batch."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(index)


def invert(rep_fn: Callable[[jnp.ndarray], jnp.ndarray], targets: jnp.ndarray, image_shape: Sequence[int],
           cfg: InversionConfig, key: jax.Array, index: Optional[jnp.ndarray] = None
           ) -> tuple[jnp.ndarray, jnp.ndarray]:
  """The attack vmapped over targets [T, d] (call it under jax.jit, or use `invert_padded`): (images [T, H, W, C],
  final representation losses [T]). Target t uses key fold_in(key, index[t]) (default index t)."""
  index = jnp.arange(targets.shape[0]) if index is None else jnp.asarray(index)
  return jax.vmap(lambda t, k: invert_one(rep_fn, t, image_shape, cfg, k))(targets, target_keys(key, index))


def invert_padded(run: Callable[[jnp.ndarray, jnp.ndarray], tuple[jnp.ndarray, jnp.ndarray]], targets: np.ndarray,
                  batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
  """`run(targets [batch, d], index [batch])` (a jitted `invert`, e.g. of `inverter`) over any number of targets
  [T, d] in batches of `batch` rows, the last padded with copies of the first row (masked: cut back after), so one
  compiled function serves every T. Returns (images [T, H, W, C], representation losses [T]) as numpy."""
  targets = np.asarray(targets, np.float32)
  if batch < 1:
    raise ConfigError(f'--inversion_batch={batch} must be >= 1.')
  n = targets.shape[0]
  if n == 0:
    raise ConfigError('the upload holds no vectors to invert (a client without training rows?); choose other '
                      '--attack_clients.')
  pad = (-n) % batch
  padded = np.concatenate([targets, np.repeat(targets[:1], pad, 0)])
  images, losses = [], []
  for s in range(0, n + pad, batch):
    im, lo = run(jnp.asarray(padded[s:s + batch]), jnp.arange(s, s + batch))
    images.append(np.asarray(im))
    losses.append(np.asarray(lo))
  return np.concatenate(images)[:n], np.concatenate(losses)[:n]


def inverter(model: Any, image_shape: Sequence[int], cfg: InversionConfig) -> Callable:
  """The attack through a classifier's eval-mode extractor, jitted once per architecture:
  run(params, model_state, key, targets [B, d], index [B]) -> (images [B, H, W, C], representation losses [B])."""
  def run(params, model_state, key, targets, index):
    return invert(extractor_fn(model, params, model_state), targets, image_shape, cfg, key, index)
  return jax.jit(run)


def extractor_fn(model: Any, params: Any, model_state: Any) -> Callable[[jnp.ndarray], jnp.ndarray]:
  """RM(g(.)) of a client's classifier in eval mode: x [B, H, W, C] -> reps [B, d] (`models.forward`)."""
  from fedjax_het.models.forward import forward
  return lambda x: forward(model, params, model_state, x, False)[1]


# ---------------------------------------------------------------------------------------------------- uploads
class Targets(NamedTuple):
  """What one client's upload offers the attacker: kind ('representation', 'prototype', 'entangled'), vectors
  [T, d], labels [T] (the class of a prototype, the row's label for a representation, the entangled label's
  arg-max otherwise), rows [T] (the training row of a representation, -1 otherwise) and weights [T, C] (the
  target's class weights: its soft label, one-hot for a prototype or a representation)."""
  kind: str
  vectors: np.ndarray
  labels: np.ndarray
  rows: np.ndarray
  weights: np.ndarray


def upload_targets(upload: dict, limit: int = 0, min_class_samples: int = 1) -> Targets:
  """One client's upload pytree -> its `Targets` (at most `limit` of them when limit > 0).

  {'rep', 'label', 'weight'} (FedRE): every row with weight > 0 is a representation when the upload has several
  rows (FedAllRep; the first ones), an entangled representation when it has one; {'protos', 'counts'} (FedProto,
  FedGH, FedTGP, FPL, FedVTC) and {'means', 'counts'} (CCVR): the classes with at least `min_class_samples` samples
  are prototypes, the most populated first (a prototype of a few samples is nearly a representation). Anything
  else is a ConfigError: the method uploads no d-vectors to invert. The result may hold no target.
  """
  upload = {k: np.asarray(v) for k, v in upload.items()} if isinstance(upload, dict) else {}
  if 'rep' in upload and 'weight' in upload:
    sent = np.flatnonzero(upload['weight'] > 0)
    kind = 'representation' if upload['rep'].shape[0] > 1 else 'entangled'
    soft = upload['label'][sent] if 'label' in upload else np.ones((len(sent), 1))
    labels = np.argmax(soft, -1)
    rows = sent if kind == 'representation' else np.full(len(sent), -1)
    vectors = upload['rep'][sent]
  elif ('protos' in upload or 'means' in upload) and 'counts' in upload:
    counts = upload['counts']
    sent = np.array([c for c in np.argsort(-counts, kind='stable') if counts[c] >= max(min_class_samples, 1)],
                    int)
    kind, labels, rows = 'prototype', sent, np.full(len(sent), -1)
    soft = np.eye(len(counts))[sent]
    vectors = upload['protos' if 'protos' in upload else 'means'][sent]
  else:
    raise ConfigError(f'--algorithm: its upload ({", ".join(sorted(upload)) or type(upload).__name__}) holds no '
                      f'representations or class vectors to invert; the attack covers FedAllRep, FedRE, FedProto, '
                      f'FedGH, FedTGP, FPL, CCVR and FedVTC.')
  if limit > 0:
    vectors, labels, rows, soft = vectors[:limit], labels[:limit], rows[:limit], soft[:limit]
  return Targets(kind, np.asarray(vectors, np.float32), np.asarray(labels), np.asarray(rows),
                 np.asarray(soft, np.float32))


class ClientUpload(NamedTuple):
  """One attacked client after its round: id, its group's index, its trained `ClientState` (the extractor that
  produced the upload), its upload pytree, and its training rows x [n_max, ...], y [n_max], n (real rows)."""
  client: int
  group: int
  state: Any
  upload: Any
  x: np.ndarray
  y: np.ndarray
  n: int


def round_uploads(fed: Any, state: Any, clients: Sequence[int]) -> list[ClientUpload]:
  """The uploads the chosen `clients` send in round state.round + 1 of `fed` (a `Federation`) from `state`: each
  group's program of that round's phase, run by the federation's executor with that round's broadcast and keys,
  as `Federation.round` runs it (a client's upload does not depend on which others run with it). `state` is not
  changed; no server step runs. Raises ConfigError for an unknown client id or a round past the run's end."""
  r = int(state.round)
  if r >= fed.total_rounds:
    raise ConfigError(f'--rounds: the state is after round {r}, the run\'s last; nothing is uploaded after it.')
  unknown = sorted(set(int(c) for c in clients) - set(range(fed.num_clients)))
  if unknown:
    raise ConfigError(f'--attack_clients={",".join(map(str, clients))}: clients {unknown} do not exist (ids 0 to '
                      f'{fed.num_clients - 1}).')
  p = fed.phase_index(r)
  key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(fed.seed), r + 1))[0]  # as Federation.round
  out = []
  for gi, g in enumerate(fed.groups):
    local = [i for i, c in enumerate(g.clients) if int(c) in set(int(k) for k in clients)]
    if not local:
      continue
    stacked = jax.tree.map(jnp.copy, state.groups[gi])  # the vmap executor donates its input
    broadcast = fed.broadcast(state.server, gi, r)
    slot_idx = np.asarray(local, np.int32)
    new, values, _ = fed.executor.run(g, fed.programs[p][gi], p, stacked, slot_idx, broadcast, key)
    for j, i in enumerate(local):
      out.append(ClientUpload(int(g.clients[i]), gi, jax.tree.map(lambda a: a[i], new),
                              jax.tree.map(lambda a: np.asarray(a[j]), values),
                              np.asarray(g.train.x[i]), np.asarray(g.train.y[i]), int(g.train_sizes[i])))
  return sorted(out, key=lambda u: u.client)


def attack_client(fed: Any, cu: ClientUpload, cfg: InversionConfig, key: jax.Array, limit: int = 0,
                  batch: int = 8, compiled: Optional[dict] = None, min_class_samples: int = 1) -> Optional[dict]:
  """Inverts one client's upload through its own trained extractor and measures the leakage (module docstring):
  {'kind', 'labels', 'reconstructions', 'references', 'originals' (the best matches) [T, H, W, C]; per target
  'psnr' and 'mse' against the reference, 'null_psnr' (the null image against it), 'best_psnr', 'best_null_psnr'
  (best match of the reconstruction, of the null image), 'rep_loss'}; None when the upload offers no target.
  `compiled`: a dict caching one `inverter` per group across calls."""
  g = fed.groups[cu.group]
  targets = upload_targets(cu.upload, limit, min_class_samples)
  if not len(targets.vectors):
    return None
  compiled = {} if compiled is None else compiled
  if cu.group not in compiled:
    compiled[cu.group] = inverter(g.model, cu.x.shape[1:], cfg)
  run = compiled[cu.group]
  client_key = jax.random.fold_in(key, cu.client)
  images, rep_loss = invert_padded(lambda t, i: run(cu.state.params, cu.state.model_state, client_key, t, i),
                                   targets.vectors, batch)
  valid = np.arange(cu.x.shape[0]) < cu.n
  allowed = candidate_mask(targets.kind, jnp.asarray(cu.y), jnp.asarray(valid), jnp.asarray(targets.rows),
                           jnp.asarray(targets.labels))
  best = jax.device_get(leakage(jnp.asarray(images), jnp.asarray(cu.x), allowed))
  null = jnp.full_like(jnp.asarray(images), NULL_IMAGE)
  best_null = jax.device_get(leakage(null, jnp.asarray(cu.x), allowed))
  refs = np.asarray(reference_images(targets.kind, jnp.asarray(targets.weights), jnp.asarray(targets.rows),
                                     jnp.asarray(cu.x), jnp.asarray(cu.y), jnp.asarray(valid)))
  mse = np.asarray(mse_255(jnp.asarray(images), jnp.asarray(refs)))
  return {'kind': targets.kind, 'labels': targets.labels, 'reconstructions': images, 'references': refs,
          'originals': cu.x[np.maximum(best['match'], 0)], 'psnr': np.asarray(psnr_from_mse(mse)), 'mse': mse,
          'null_psnr': np.asarray(psnr_255(null, jnp.asarray(refs))), 'best_psnr': np.asarray(best['psnr']),
          'best_null_psnr': np.asarray(best_null['psnr']), 'rep_loss': rep_loss}


# ---------------------------------------------------------------------------------------------------- reports
def mean_std(values: Sequence[float], digits: int = 2) -> str:
  """'mean +- std' (population std) of finite values; '-' when there are none."""
  v = np.asarray(values, float)
  v = v[np.isfinite(v)]
  return '-' if not len(v) else f'{v.mean():.{digits}f} +- {v.std():.{digits}f}'


def leakage_table(results: Sequence[dict]) -> str:
  """Markdown: per method (in order), its upload kind and targets, then each measure as mean +- std over the
  seeds' means: PSNR (dB) and MSE (0-255) against the reference, the PSNR's gain over the null image's, the
  best-match PSNR and its gain over the null image's best match, the identification rate against its chance
  level, the attack's final representation loss and the accuracy after the attacked round. `results`: dicts with
  'method', 'seed', 'kind', arrays over that run's targets 'psnr', 'mse', 'null_psnr', 'best_psnr',
  'best_null_psnr', 'identified', 'rep_loss', and 'accuracy' (None when not evaluated)."""
  lines = ['| method | upload | targets | PSNR vs reference (dB) | gain over null (dB) | MSE vs reference | '
           'best-match PSNR (dB) | gain over null (dB) | identified (%) | chance (%) | attack loss | accuracy (%) | '
           'seeds |', '|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for name in dict.fromkeys(r['method'] for r in results):
    runs = [r for r in results if r['method'] == name]
    per_seed = lambda f, digits=2: mean_std([f(r) for r in runs], digits)
    mean = lambda k: (lambda r: float(np.mean(np.asarray(r[k], float))))
    gain = lambda a, b: (lambda r: float(np.mean(np.asarray(r[a], float) - np.asarray(r[b], float))))
    acc = [100 * r['accuracy'] for r in runs if r.get('accuracy') is not None]
    lines.append(f'| {name} | {"/".join(dict.fromkeys(r["kind"] for r in runs))} | '
                 f'{sum(len(r["psnr"]) for r in runs)} | {per_seed(mean("psnr"))} | '
                 f'{per_seed(gain("psnr", "null_psnr"))} | {per_seed(mean("mse"), 1)} | {per_seed(mean("best_psnr"))} | '
                 f'{per_seed(gain("best_psnr", "best_null_psnr"))} | '
                 f'{per_seed(lambda r: 100 * float(np.mean(r["identified"])), 1)} | '
                 f'{per_seed(lambda r: 100 / len(r["psnr"]), 1)} | {per_seed(mean("rep_loss"), 3)} | '
                 f'{mean_std(acc) if acc else "-"} | {len(runs)} |')
  return '\n'.join(lines) + '\n'


def plot_reconstructions(panels: Sequence[tuple[str, np.ndarray, np.ndarray]], path: str, title: str = '') -> None:
  """The paper's Figure 4: per panel (label, references [T, H, W, C], reconstructions [T, H, W, C], images in
  [-1, 1]) a row of the images the uploads describe above a row of their reconstructions; a PNG at `path`."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  cols = max(len(o) for _, o, _ in panels)
  fig, axes = plt.subplots(2 * len(panels), cols, figsize=(1.1 * cols + 1.6, 2.3 * len(panels) + 0.5),
                           squeeze=False)
  for p, (label, originals, recons) in enumerate(panels):
    for row, (imgs, what) in enumerate(((originals, 'reference'), (recons, 'reconstruction'))):
      for c in range(cols):
        ax = axes[2 * p + row, c]
        ax.set_xticks([])
        ax.set_yticks([])
        for s in ax.spines.values():
          s.set_visible(False)
        if c < len(imgs):
          im = np.clip((np.asarray(imgs[c], np.float32) + 1) / 2, 0, 1)
          ax.imshow(im[..., 0] if im.shape[-1] == 1 else im, cmap='gray' if im.shape[-1] == 1 else None,
                    vmin=0, vmax=1)
      axes[2 * p + row, 0].set_ylabel(f'{label}\n{what}' if row == 0 else what, fontsize=8)
  if title:
    import textwrap
    fig.suptitle(textwrap.fill(title, 100), fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
