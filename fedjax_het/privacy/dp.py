"""Client-level differential privacy for whatever a method uploads: `privatize(algorithm, DPConfig(...))` returns
the `Algorithm` whose clients clip their contribution and whose uploads carry Gaussian noise, in optax's style (a
transformation of the method, not an option inside it).

A client's contribution is the private parts of its upload (`core.UploadPrivacy`: every part but the method's
public ones, and those of them --dp_parts adds; a part that is not floating point cannot take the noise, and is
refused), measured from the broadcast where the method says the part is a
model it received (the model delta, as DP-FedAvg clips it). It is clipped to L2 norm C, as one vector (the client's
set of class prototypes, its entangled representation, its logit table, its model delta) or, with
`clip_parts='each'`, each part to C / sqrt(P) so that the whole stays within C. Noise N(0, sigma^2 C^2):

- local: each client noises its own upload before it leaves; nobody, the server included, sees it unnoised.
- central: a trusted server noises before its step: once per sum for a method whose server reads the private parts
  only through means over the participants (DP-FedAvg; `UploadPrivacy.aggregate` 'sum' / 'group_sum'; the sum's
  noise is drawn as shares of the holders of each entry, so every sum carries exactly N(0, sigma^2 C^2)), and to
  each upload for a method whose server reads each upload on its own ('records', e.g. FedRE's head training).

Under DP every server step weighs participants equally (the sample counts used as weights would leak). Under the
engine's fixed-size draw neighbouring federations replace one client (the sensitivity of a clipped contribution is
2C; `privacy.budget` accounts it so). Under Poisson sampling (`--participation=poisson`) a method whose server reads
the private parts only through means over all participants divides their noised sum by the expected count qN, not
by the number drawn (`fixed_denominator`: the fixed-denominator estimator of "Learning Differentially Private
Recurrent Language Models", McMahan et al., ICLR 2018), and a round that drew nobody still releases the noise
alone, so the release is the sum's Gaussian mechanism under add/remove adjacency (sensitivity C) whatever the draw.
What is not protected: parts a method declares public (FedProto's and FD's per-class counts: which classes a client
holds), the participant set where the draw does not amplify (the server draws it), and what a simulation measures
beside the protocol (evaluation).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from fedjax_het.core import Algorithm, Phase, UploadPrivacy, Uploads
from fedjax_het.errors import ConfigError
from fedjax_het.uploads import RoundUploads, parts as parts_of, with_parts

MODES = ('off', 'central', 'local')
AGGREGATES = ('records', 'sum', 'group_sum')
_DP_STREAM = 0x44502D  # folded into a client's or the server's key: noise draws that change no other draw


@dataclasses.dataclass(frozen=True)
class DPConfig:
  """mode: 'off', 'central' or 'local'; clip: the L2 bound C of a client's contribution; noise_multiplier: sigma
  (the noise's standard deviation is sigma * C); clip_parts: 'whole' (the contribution as one vector) or 'each'
  (each part to C / sqrt(parts)); parts: public parts of the method's upload made private too (FedRE's label);
  every other part is private already; fixed_denominator: central mode under Poisson sampling, means over the
  participants divided by the expected count (`fixed_denominator`), for a method that claims amplification."""
  mode: str = 'off'
  clip: float = 1.0
  noise_multiplier: float = 0.0
  clip_parts: str = 'whole'
  parts: tuple[str, ...] = ()
  fixed_denominator: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ConfigError(f'DPConfig.mode={self.mode!r} must be one of {", ".join(MODES)}.')
    if not (math.isfinite(self.clip) and self.clip > 0):
      raise ConfigError(f'DPConfig.clip={self.clip} must be a positive number (the L2 bound of a contribution).')
    if not (math.isfinite(self.noise_multiplier) and self.noise_multiplier >= 0):
      raise ConfigError(f'DPConfig.noise_multiplier={self.noise_multiplier} must be a number >= 0.')
    if self.clip_parts not in ('whole', 'each'):
      raise ConfigError(f'DPConfig.clip_parts={self.clip_parts!r} must be \'whole\' or \'each\'.')
    object.__setattr__(self, 'parts', tuple(self.parts))

  @property
  def noise_std(self) -> float:
    """The standard deviation of the noise on each coordinate of a sum (central) or an upload (local)."""
    return self.noise_multiplier * self.clip


def private_parts(upload: Any, declared: UploadPrivacy, dp: DPConfig, where: str) -> tuple:
  """The top-level parts of `upload` that are a client's contribution: every part but the method's public ones,
  and the public ones `dp.parts` adds (the whole upload, ('all',), when it is not a dict). A ConfigError for one
  that is not floating point (labels, counts): Gaussian noise cannot protect it."""
  parts = parts_of(upload)
  names = tuple(k for k, v in parts.items()
                if (k not in declared.public or k in dp.parts) and jax.tree.leaves(v))
  for k in names:
    kinds = {str(jnp.asarray(a).dtype) for a in jax.tree.leaves(parts[k])
             if not jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)}
    if kinds:
      raise ConfigError(f'DPConfig.mode={dp.mode!r}: {where} uploads {k!r} as {", ".join(sorted(kinds))}, which '
                        f'Gaussian noise cannot protect, so this method does not run under DP. Fix: '
                        f'DPConfig.mode=\'off\' (or, where that part carries no data, declare it public in the '
                        f'method\'s UploadPrivacy).')
  return names


def clip_contribution(contribution: dict, dp: DPConfig) -> dict:
  """The contribution scaled to L2 norm at most C: as one vector, or each part to C / sqrt(number of parts)."""
  if dp.clip_parts == 'whole':
    return optax.clip_by_global_norm(dp.clip).update(contribution, optax.EmptyState())[0]
  bound = dp.clip / math.sqrt(len(contribution))
  return {k: optax.clip_by_global_norm(bound).update(v, optax.EmptyState())[0] for k, v in contribution.items()}


def gaussian_noise(tree: Any, key: jax.Array, std: Any) -> Any:
  """Independent N(0, std^2) draws shaped like `tree` (std broadcastable to each leaf)."""
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, max(len(leaves), 1))
  return treedef.unflatten([std * jax.random.normal(k, jnp.shape(a), jnp.result_type(a))
                            for a, k in zip(leaves, keys)])


def _tree_add(a: Any, b: Any) -> Any:
  return jax.tree.map(jnp.add, a, b)


def privatize_upload(upload: Any, broadcast: Any, declared: UploadPrivacy, dp: DPConfig, key: jax.Array,
                     where: str) -> Any:
  """One client's upload as it leaves the client: its private parts' contribution (from the declared reference)
  clipped, and noised in local mode."""
  names = private_parts(upload, declared, dp, where)
  if not names:
    return upload
  parts = parts_of(upload)
  reference = declared.reference(broadcast) if declared.reference is not None else {}
  delta = {k: (jax.tree.map(jnp.subtract, parts[k], reference[k]) if k in reference else parts[k]) for k in names}
  delta = clip_contribution(delta, dp)
  if dp.mode == 'local':
    delta = _tree_add(delta, gaussian_noise(delta, key, dp.noise_std))
  sent = {k: (_tree_add(delta[k], reference[k]) if k in reference else delta[k]) for k in names}
  return with_parts(upload, sent)


def central_noise(uploads: tuple, declared: UploadPrivacy, dp: DPConfig, key: jax.Array, where: str) -> tuple:
  """The groups' `Uploads` with the trusted server's noise: N(0, sigma^2 C^2) on each participant's private parts
  ('records'), or, for a server that reads them only through sums over the holders of each entry (across groups for
  'sum', within each for 'group_sum'), shares N(0, sigma^2 C^2 / h) on each of the h holders, so that each sum
  carries N(0, sigma^2 C^2) once."""
  one = jax.tree.map(lambda a: a[0], uploads[0].values)
  names = private_parts(one, declared, dp, where)
  if not names:
    return uploads

  def holders(u: Uploads) -> dict:
    """[S, ...] per private part: 1 where a participant holds the entry."""
    parts = parts_of(u.values)
    held = jax.vmap(declared.holds)(u.values) if declared.holds is not None else {}
    out = {}
    for k in names:
      def per_leaf(a, k=k):
        h = held.get(k, True)
        mask = u.mask.reshape((-1,) + (1,) * (a.ndim - 1))
        return jnp.broadcast_to(jnp.asarray(h) & mask, a.shape).astype(a.dtype)
      out[k] = jax.tree.map(per_leaf, parts[k])
    return out

  held = [holders(u) for u in uploads]
  if declared.aggregate == 'records':
    counts = [jax.tree.map(lambda h: jnp.ones_like(h[:1]), h) for h in held]
  elif declared.aggregate == 'group_sum':
    counts = [jax.tree.map(lambda h: jnp.sum(h, 0, keepdims=True), h) for h in held]
  else:  # 'sum': the holders of each entry across every group (the groups' uploads have one shape per part)
    total = jax.tree.map(lambda *hs: sum(jnp.sum(h, 0, keepdims=True) for h in hs), *held)
    counts = [total] * len(held)
  out = []
  for gi, (u, h, c) in enumerate(zip(uploads, held, counts)):
    parts = parts_of(u.values)
    private = {k: parts[k] for k in names}
    noise = gaussian_noise(private, jax.random.fold_in(key, gi), dp.noise_std)
    shares = jax.tree.map(lambda z, hk, ck: z * hk / jnp.sqrt(jnp.maximum(ck, 1.0)), noise, h, c)
    out.append(u._replace(values=with_parts(u.values, _tree_add(private, shares))))
  return tuple(out)


def fixed_denominator(uploads: tuple, reference: dict, names: Sequence[str], dp: DPConfig, key: jax.Array
                      ) -> tuple:
  """The groups' noised `Uploads` rescaled so that a server's unweighted mean over the k participants equals their
  sum over the expected count E = `Uploads.expected` (DP-FedAvg's fixed denominator): each private part
  x -> r + (k / E)(x - r), r its reference (0 where it has none), so the mean is r + (sum of contributions + noise) / E.
  In a round that drew nobody the first slot of the first group becomes a participant carrying r + Z / E,
  Z ~ N(0, sigma^2 C^2): the noise alone, so that such a round is released as any other."""
  expected = uploads[0].expected[0]
  drawn = sum(jnp.sum(u.mask.astype(jnp.float32)) for u in uploads)
  nobody = drawn == 0

  def around(part, tree, f):
    if part in reference:
      return jax.tree.map(lambda x, r: r + f(x - r), tree, reference[part])
    return jax.tree.map(f, tree)
  out = []
  for gi, u in enumerate(uploads):
    parts = parts_of(u.values)
    scaled = {n: around(n, parts[n], lambda x: (drawn / expected) * x) for n in names}
    mask = u.mask
    if gi == 0:
      noise = gaussian_noise({n: jax.tree.map(lambda a: a[0], parts[n]) for n in names}, key, dp.noise_std)
      shift = lambda n: jax.tree.map(lambda z, r: r + z / expected, noise[n], reference[n])
      alone = {n: shift(n) if n in reference else jax.tree.map(lambda z: z / expected, noise[n]) for n in names}
      scaled = jax.tree.map(lambda a, z: a.at[0].set(jnp.where(nobody, z, a[0])), scaled, alone)
      mask = mask.at[0].set(mask[0] | nobody)
    out.append(u._replace(values=with_parts(u.values, scaled), mask=mask, num_train=mask.astype(jnp.float32)))
  return tuple(out)


def _private_phase(phase: Phase, algorithm: Algorithm, dp: DPConfig) -> Phase:
  declared = algorithm.upload_privacy
  where = f'{algorithm.name}, phase {phase.name!r}'

  def client(group):
    program = phase.client(group)

    def final(carry, rows, broadcast, key):
      client_state, upload = program.final(carry, rows, broadcast, key)
      return client_state, privatize_upload(upload, broadcast, declared, dp, jax.random.fold_in(key, _DP_STREAM),
                                            where)
    return program._replace(final=final)

  def private_step(step, spec=None):
    def server_update(server, uploads, key, *constants):
      uploads = tuple(u._replace(num_train=u.mask.astype(jnp.float32)) for u in uploads)  # equal weights
      noise_key = jax.random.fold_in(key, _DP_STREAM)
      if dp.mode == 'central':
        uploads = central_noise(uploads, declared, dp, noise_key, where)
      if dp.mode == 'central' and dp.fixed_denominator:
        names = private_parts(jax.tree.map(lambda a: a[0], uploads[0].values), declared, dp, where)
        reference = (declared.reference(phase.broadcast(server, spec.groups[0])) if declared.reference is not None
                     else {})
        uploads = fixed_denominator(uploads, reference, names, dp, jax.random.fold_in(noise_key, 1))
      return step(server, RoundUploads(u._replace(expected=None) for u in uploads), key, *constants)
    return server_update

  if dp.mode == 'central' and dp.fixed_denominator:  # the step reads the broadcast, and runs in every round
    inner = phase.server_update
    return dataclasses.replace(phase, client=client, server_of_spec=True, runs_without_participants=True,
                               server_update=lambda spec: private_step(
                                   inner(spec) if phase.server_of_spec else inner, spec))
  server_update = ((lambda spec: private_step(phase.server_update(spec))) if phase.server_of_spec
                   else private_step(phase.server_update))
  return dataclasses.replace(phase, client=client, server_update=server_update)


def claims_amplification(declared: UploadPrivacy, dp_parts: Sequence[str] = (), participation: str = 'fixed'
                         ) -> bool:
  """Whether central accounting may count on the random draw of participants (amplification by sampling): the
  method declares that its server's releases hide who took part (`UploadPrivacy.hides_participants`) and nothing
  it releases without noise depends on who took part, i.e. none of its upload parts stays public (each one made
  private with `dp_parts`). FedRE's soft label trains the released head: left public, the head's bias carries the
  participants' label supports in the clear, which under a skewed split say who was drawn. Under Poisson sampling
  also only a server that reads the private parts through means over all participants (`aggregate='sum'`, every
  entry held by all), which a fixed denominator makes independent of how many were drawn; one that reads each
  upload on its own sees the count of uploads, which tells an added client from none."""
  hides = declared.hides_participants and not (set(declared.public) - set(dp_parts))
  if participation == 'poisson':
    return hides and declared.aggregate == 'sum' and declared.holds is None
  return hides


def privatize(algorithm: Algorithm, dp: Optional[DPConfig]) -> Algorithm:
  """`algorithm` with client-level DP on every phase's uploads (the module docstring); unchanged when `dp` is None
  or its mode 'off'."""
  if dp is None or dp.mode == 'off':
    return algorithm
  if dp.noise_multiplier <= 0:
    raise ConfigError(f'DPConfig.noise_multiplier={dp.noise_multiplier}: with mode {dp.mode!r} the noise must be '
                      f'positive, or epsilon is infinite. Fix: a positive DPConfig.noise_multiplier, or a target '
                      f'epsilon to calibrate it (--dp_target_epsilon).')
  declared = algorithm.upload_privacy
  if declared.aggregate not in AGGREGATES:
    raise ConfigError(f'UploadPrivacy.aggregate={declared.aggregate!r} ({algorithm.name}) must be one of '
                      f'{", ".join(AGGREGATES)}.')
  unknown = [p for p in dp.parts if p not in declared.public]
  if unknown:
    raise ConfigError(f'DPConfig.parts={",".join(dp.parts)}: {algorithm.name} has no public upload part '
                      f'{", ".join(unknown)}; the parts this flag can add to the private ones are '
                      f'{", ".join(declared.public) or "none"} (every other part is private already). Fix: '
                      f'DPConfig.parts from those, or empty.')
  if dp.fixed_denominator and not claims_amplification(declared, dp.parts, 'poisson'):
    raise ConfigError(f'DPConfig.fixed_denominator: {algorithm.name}\'s server does not read its uploads only through '
                      f'means over all participants, so dividing by the expected count does not hide how many were '
                      f'drawn. Fix: DPConfig.fixed_denominator=False.')
  if dp.parts and declared.holds is not None:
    raise ConfigError(f'DPConfig.parts={",".join(dp.parts)}: {algorithm.name}\'s server reads from its public '
                      f'parts which entries each client holds, one upload at a time, so they stay public (stated in '
                      f'docs/privacy.md). Fix: DPConfig.parts empty.')
  phases = tuple(_private_phase(phase, algorithm, dp) for phase in algorithm.phases)
  return dataclasses.replace(algorithm, phases=phases)
