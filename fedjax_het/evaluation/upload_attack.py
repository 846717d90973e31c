"""What the inversion attack reads: a round's uploads of chosen clients, turned into targets, and one client's
attack with its leakage (`attack_client`).

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

from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_het.core import parts
from fedjax_het.errors import ConfigError
from fedjax_het.evaluation.attack import InversionConfig, invert_padded, inverter
from fedjax_het.evaluation.metrics import (NULL_IMAGE, candidate_mask, leakage, mse_255, psnr_255, psnr_from_mse,
                                           reference_images, ssim_255)

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
  upload = {k: np.asarray(v) for k, v in parts(upload).items() if k != 'all' and hasattr(v, 'shape')}
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
    stacked = jax.device_put(state.groups[gi], may_alias=False)  # the vmap executor donates its input
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
  'psnr', 'mse' and 'ssim' against the reference, 'null_psnr' and 'null_ssim' (the null image against it),
  'best_psnr', 'best_null_psnr' (best match of the reconstruction, of the null image), 'rep_loss'}; None when the upload offers no target.
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
          'best_null_psnr': np.asarray(best_null['psnr']), 'rep_loss': rep_loss,
          'ssim': np.asarray(ssim_255(jnp.asarray(images), jnp.asarray(refs))),
          'null_ssim': np.asarray(ssim_255(null, jnp.asarray(refs)))}
