"""Train and evaluate one configuration: the round loop, metrics.jsonl, summary.json, plots, checkpoints and resume.

The workdir (`fedjax_het.run.workdir`) is locked while a run uses it and refused to a second run unless it resumes;
checkpoints (`fedjax_het.run.checkpoints`) carry the identity of their run, which --resume checks. Ctrl-C or SIGTERM
finishes the current round, checkpoints it and stops (`fedjax_het.run.interrupts`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import jax
import numpy as np
from absl import logging

from fedjax_het.core import Algorithm
from fedjax_het.data.datasets import load_dataset
from fedjax_het.data.federated import FederatedData, make_federated_data
from fedjax_het.engine.federation import Federation, wants_progress_bar
from fedjax_het.engine.schedule import Schedule
from fedjax_het.errors import ConfigError
from fedjax_het.robust import robust_aggregation
from fedjax_het.run import distributed
from fedjax_het.run.checkpoints import Checkpoints
from fedjax_het.run.config import ExperimentConfig, flags_named, resumable_settings, run_settings
from fedjax_het.run.interrupts import Interrupted, StopAtRoundEnd
from fedjax_het.run.plots import plot_accuracy, plot_partition, plot_samples
from fedjax_het.run.registry import METHODS, Run, config_flags, method
from fedjax_het.run.tensorboard import FOLDER as TENSORBOARD_FOLDER, ScalarLog, summary_writer_class
from fedjax_het.run.workdir import Workdir, write_atomically

if TYPE_CHECKING:
  from fedjax_het.privacy.budget import PrivacyBudget


def validate(cfg: ExperimentConfig) -> None:
  """Checks the settings that need no data, so a bad flag fails in the first second with one clear message: the
  config checked its own fields when it was made; each record it builds checks its own."""
  cfg.model_config(), cfg.local_training(), cfg.execution_config()  # each names the flags in its errors


def make_algorithm(cfg: ExperimentConfig, data: FederatedData) -> Algorithm:
  """The `Algorithm` named by --algorithm (`fedjax_het.run.registry`), with its hyperparameters from the config."""
  return _make_algorithm(cfg, data)[0]


def _make_algorithm(cfg: ExperimentConfig, data: FederatedData) -> tuple[Algorithm, Run]:
  run = Run(data.num_classes, cfg.num_clients, cfg.rounds, cfg.feature_dim,
            lambda: data.loader_label_counts(cfg.batch_size, cfg.data_order == 'stored' and cfg.drop_last),
            data.public)
  with flags_named():
    return method(cfg.algorithm).algorithm(cfg.methods[cfg.algorithm], run), run


def build_federation(cfg: ExperimentConfig) -> Federation:
  """Dataset -> partition -> groups -> `Federation`, all from the config and its seed."""
  return _build(cfg)[0]


def build_federation_and_budget(cfg: ExperimentConfig) -> tuple[Federation, Optional['PrivacyBudget']]:
  """`build_federation`, and the privacy its uploads spend (sigma as the run calibrates it; None without DP)."""
  fed, _, budget = _build(cfg)
  return fed, budget


def dp_secret(cfg: ExperimentConfig, wd: Optional[Workdir] = None, resume: bool = False) -> Optional[int]:
  """The secret from which a DP run draws its noise and the participants of its amplified rounds, or None (no DP,
  or --dp_reproducible_noise: the seed instead). With a workdir, its `.dp_secret` file (made by the writing
  process from the operating system's entropy when a run starts, readable by its owner only): a resumed run
  continues the same noise and draws, and every process of a multi-process run holds the same. Without one (a
  Flower node, a tool reading a run), fresh entropy."""
  if cfg.dp_mode == 'off' or cfg.dp_reproducible_noise:
    return None
  if wd is None:
    return secrets.randbits(SECRET_BITS)
  path = wd.file(DP_SECRET_FILE)
  if resume and not os.path.lexists(path):  # never a new one: the rounds that ran drew from the lost one
    if not wd.has_checkpoints():
      raise ConfigError(_no_checkpoint_message(wd))
    raise ConfigError(f'--resume: this DP run\'s secret {path} is missing. The noise and the participant draws of its '
                      f'rounds come from it, and the accounting of the rounds that ran reads their draw from it, so '
                      f'the run cannot go on with another (nothing was changed). Fix: put back the {DP_SECRET_FILE} '
                      f'file of this run, or start the run again in a new --workdir.')
  if wd.writes and not resume:
    try:
      write_atomically(path, lambda f: f.write(str(secrets.randbits(SECRET_BITS))), mode=0o600)
    except OSError as e:
      raise ConfigError(f'--workdir: the DP secret could not be written to {path} ({e.strerror or e}). Fix: remove '
                        f'what is at that path, or use a new --workdir.') from None
  distributed.barrier('dp secret written')
  return read_dp_secret(path)


def read_dp_secret(path: str) -> int:
  """The secret in a run's `.dp_secret` file, or a ConfigError saying why it cannot be read (a folder, no
  permission, empty, not a non-negative integer)."""
  fix = (f'Fix: put back the {DP_SECRET_FILE} file of this run (a non-negative integer, readable by its owner), '
         f'or start the run again in a new --workdir.')
  try:
    with open(path) as f:
      text = f.read(4096).strip()
  except OSError as e:
    raise ConfigError(f'this DP run\'s secret {path} cannot be read ({e.strerror or e}). {fix}') from None
  except UnicodeDecodeError:
    text = '\ufffd'
  if not text:
    raise ConfigError(f'this DP run\'s secret {path} is empty. {fix}')
  if not (text.isascii() and text.isdigit()) or int(text) >= 2 ** 512:
    raise ConfigError(f'this DP run\'s secret {path} holds no secret (not a non-negative integer of at most '
                      f'512 bits). {fix}')
  return int(text)


def _build(cfg: ExperimentConfig, secret: Optional[int] = None, check: Callable[[], None] = lambda: None
           ) -> tuple[Federation, Run, Optional['PrivacyBudget']]:
  validate(cfg)
  dataset = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
  dataset = dataset.subsampled(cfg.data_fraction, cfg.seed).resized(cfg.image_size)
  dataset = dataset.normalized(cfg.input_normalization)
  caution = cfg.check_augmentation(dataset.image_shape)  # refused here where it would erase the images
  if caution is not None:
    logging.warning('%s', caution)
  public = None
  if (cfg.public_size or cfg.public_dataset) and 'public' not in method(cfg.algorithm).reads:
    logging.warning('--public_size / --public_dataset: %s reads no public data; %s', cfg.algorithm,
                    'the clients still lose the held-out rows.' if cfg.public_size and not cfg.public_dataset
                    else 'the public dataset is not used.')
  with flags_named():
    if cfg.public_dataset:
      try:
        public = load_dataset(cfg.public_dataset, cfg.data_dir, seed=cfg.seed)
      except ConfigError as e:
        raise type(e)(str(e).replace('--dataset', '--public_dataset')) from None
      public = public.matching(dataset.image_shape).normalized(cfg.input_normalization)
    data = make_federated_data(dataset, cfg.num_clients, cfg.partition, cfg.seed, cfg.eval_protocol,
                               alpha=cfg.alpha, classes_per_client=cfg.classes_per_client, balance=cfg.balance,
                               imbalance_factor=cfg.imbalance_factor, train_fraction=cfg.train_fraction,
                               public_size=cfg.public_size, public_dataset=public,
                               validation_size=cfg.server_validation_size)
  algorithm, run = _make_algorithm(cfg, data)
  with flags_named():  # the server's robust aggregation (--robust_aggregation), inside the DP layer
    algorithm = robust_aggregation(algorithm, cfg.robust_config())
  # Under DP the noise, and for amplified rounds the draw, come from a secret (`dp_secret`), not the seed.
  secret = secret if secret is not None else dp_secret(cfg)
  algorithm, budget = private_algorithm(cfg, algorithm, data.num_clients, secret, check)
  with flags_named():
    fed = Federation(algorithm, data, cfg.model_config(), cfg.local_training(), cfg.execution_config(),
                     rounds=cfg.rounds, join_ratio=cfg.join_ratio,
                     full_participation_rounds=cfg.full_participation_rounds, seed=cfg.seed, secret=secret,
                     secret_draw=budget is not None and budget.sampled, participation=cfg.participation,
                     progress_bar=False)  # the run's own display (`StartupDisplay`, --progress) instead
  check_memory_budget(cfg, fed)
  warn_of_empty_rounds(fed.schedule)  # refused instead where a DP server divides by the expected count
  return fed, run, budget


def check_memory_budget(cfg: ExperimentConfig, fed: Federation) -> None:
  """Refuses a --memory_budget_gib below what every vmapped call of some group holds on the device, known before
  anything compiles: with the clients resident, the group's client states (each at least its classifier's
  float32 parameters; a client mesh splits them over its devices) and its training rows; streamed
  (--stream_clients), one client's parameters. XLA's analysis of the compiled calls then picks the widest chunk
  that fits (`VmapExecutor.budget_width`)."""
  execution = fed.execution
  if not cfg.memory_budget_gib or execution.strategy != 'vmap' or execution.chunk_size:
    return  # no budget set, or none applies (the sequential strategy, a fixed --chunk_size)
  budget = cfg.memory_budget_bytes
  for g in fed.groups:
    params = 4 * g.num_params
    if execution.stream_clients:
      need, what = params, f'one client\'s parameters ({g.num_params:,} float32 scalars)'
    else:
      held = -(-g.stacked_size // max(execution.num_devices, 1))
      need = held * params + g.rows.nbytes()
      what = (f'its {held} client states on a device (each at least {g.num_params:,} float32 parameters) and its '
              f'training rows ({g.rows.nbytes():,} bytes)')
    if need > budget:
      stream = '' if execution.stream_clients else ', or --stream_clients (only a chunk\'s clients on the device)'
      raise ConfigError(f'--memory_budget_gib={cfg.memory_budget_gib:g} ({budget:,} bytes) is less than what every '
                        f'vmapped call of group {g.arch!r} holds on the device: {what}, {need / 2**30:.4g} GiB '
                        f'before any activation. Fix: a --memory_budget_gib well above {need / 2**30:.4g} (activations '
                        f'come on top), 0 (75% of a GPU\'s memory, no bound elsewhere){stream}.')


def lowest_expected_count(schedule: Schedule) -> float:
  """The fewest participants any round of a Poisson `schedule` expects, q N (its phases' rates; a round every
  client joins expects them all)."""
  partial = [s for s in schedule.phase_starts if s < schedule.total_rounds - schedule.full_participation_rounds]
  return min((schedule.expected_count(s) for s in partial), default=float(schedule.num_clients))


def check_expected_count(schedule: Schedule, name: str) -> None:
  """Refuses a DP run under Poisson sampling whose server divides each noised sum by an expected count q N below 1
  (the fixed denominator of an amplified run, `privacy.dp`): that multiplies the noise, and the sums, by 1 / (q N)
  (x1e8 at --join_ratio=1e-9 of 10 clients) and wrecks the model while the run finishes."""
  expected = lowest_expected_count(schedule)
  if expected < 1:
    n = schedule.num_clients
    raise ConfigError(f'--participation=poisson --join_ratio={expected / n:g} with --num_clients={n}: a round expects '
                      f'q x N = {expected:.3g} clients, and under --dp_mode=central {name}\'s server divides each '
                      f'noised sum by that expected count (the fixed-denominator mean its privacy accounting assumes, '
                      f'docs/privacy.md), which multiplies the noise {1 / expected:.3g}-fold. Fix: --join_ratio of at '
                      f'least {1 / n:.3g} (1 / --num_clients), more --num_clients, or --participation=fixed.')


def warn_of_empty_rounds(schedule: Schedule) -> None:
  """A warning where Poisson sampling expects fewer than one participant a round (no DP, or a DP run whose
  server does not divide by the expected count): most rounds then draw nobody and train nothing."""
  expected = lowest_expected_count(schedule) if schedule.poisson else float('inf')
  if expected < 1:
    logging.warning('--participation=poisson --join_ratio=%g with --num_clients=%d: a round expects %.3g clients, so '
                    'most rounds draw nobody and train nothing. A --join_ratio of at least %.3g (1 / --num_clients) '
                    'expects one.', expected / schedule.num_clients, schedule.num_clients, expected,
                    1 / schedule.num_clients)


def private_algorithm(cfg: ExperimentConfig, algorithm: Algorithm, num_clients: int, secret: Optional[int] = None,
                      check: Callable[[], None] = lambda: None) -> tuple[Algorithm, Optional['PrivacyBudget']]:
  """`algorithm` under --dp_mode (`privacy.dp.privatize`) and the privacy its run spends, with sigma calibrated
  to --dp_target_epsilon over the run's schedule when that is set; (algorithm, None) without DP. `secret`: the
  run's secret (`dp_secret`), from which the participants of amplified rounds are drawn. `check`: called while
  the calibration works (`privacy.budget.calibrate`), to stop it by raising (a stop signal)."""
  if cfg.dp_mode == 'off':
    return algorithm, None
  from fedjax_het.privacy.budget import PrivacyBudget, calibrate  # dp-accounting, only for DP runs
  from fedjax_het.privacy.dp import claims_amplification, privatize
  amplified = cfg.dp_mode == 'central' and claims_amplification(algorithm.upload_privacy, cfg.dp_parts,
                                                                 cfg.participation)
  with flags_named():
    schedule = Schedule(algorithm.name, algorithm.phases, num_clients, cfg.rounds, cfg.join_ratio,
                        cfg.full_participation_rounds, secret if amplified and secret is not None else cfg.seed,
                        participation=cfg.participation)
  public = tuple(p for p in algorithm.upload_privacy.public if p not in cfg.dp_parts)
  with flags_named():
    budget = PrivacyBudget(schedule, cfg.dp_mode, cfg.dp_noise_multiplier, cfg.dp_delta, cfg.dp_accountant,
                           amplified, cfg.dp_allow_large_delta, public, 'seed' if secret is None else 'secret')
    if budget.hides_count:  # the fixed denominator: each mean is a noised sum over the expected count qN
      check_expected_count(schedule, algorithm.name)
    if cfg.dp_target_epsilon > 0:
      budget = budget.with_noise(calibrate(budget, cfg.dp_target_epsilon, check))
      logging.info('--dp_target_epsilon=%g: noise multiplier %.4f over %d rounds.', cfg.dp_target_epsilon,
                   budget.noise_multiplier, schedule.total_rounds)
    fixed_denominator = amplified and schedule.poisson
    return privatize(algorithm, cfg.dp_config(budget.noise_multiplier, fixed_denominator)), budget


# Under DP, round metrics computed from the participants' data or telling which clients took part, which no noise
# covers: not written (the run still stops when the loss is NaN/inf, a one-bit release). Flower's counts of the nodes
# that answered an evaluation, and which were left out, likewise.
WITHHELD_UNDER_DP = ('train_loss', 'local_steps', 'local_samples', 'missing_clients', 'rejected_clients',
                     'evaluated_clients', 'rejected_scores')
# Where the accounting counts on a secret draw: each client's own accuracy, which changes where its model trained,
# so that the clients whose accuracy moved are among those drawn.
PER_CLIENT_EVALUATION = ('client_accuracy',)


def released_metrics(metrics: dict, budget: 'PrivacyBudget') -> dict:
  """A round's metrics as a DP run writes them (rows, TensorBoard, checkpoints' copies): without
  `WITHHELD_UNDER_DP` and without per-round timings (`*_seconds`: how long the participants' local work took, a
  proxy of their data and of how many were drawn; summary.json keeps the run's total); where the accounting counts
  on the draw staying secret (`PrivacyBudget.sampled`), without `PER_CLIENT_EVALUATION`; and where it counts on a
  Poisson draw staying secret (`PrivacyBudget.hides_count`), without the participant count and what crossed, which
  tell how many clients were drawn."""
  counts = lambda k: k in ('participants', 'drawn') or k.startswith(('upload_', 'broadcast_'))
  return {k: v for k, v in metrics.items()
          if k not in WITHHELD_UNDER_DP and not k.endswith('_seconds')
          and not (budget.sampled and k in PER_CLIENT_EVALUATION) and not (budget.hides_count and counts(k))}


def release_policy(budget: 'PrivacyBudget') -> dict:
  """What the rows of a DP run leave out (`released_metrics`), for summary.json's dp block."""
  return {'evaluation': ('aggregates over every client only (accuracy, client_accuracy_mean, client_accuracy_std): '
                         'per-client accuracies are withheld, since the accounting counts on the draw staying secret '
                         'and a client\'s accuracy moves where its model trained' if budget.sampled else
                         'per client and aggregated (the accounting takes the draw as public)'),
          'timings': 'the run\'s total only (summary seconds); per-round timings withheld',
          'withheld': sorted(set(WITHHELD_UNDER_DP) | (set(PER_CLIENT_EVALUATION) if budget.sampled else set()))
                      + (['participants', 'drawn', 'upload_*', 'broadcast_*'] if budget.hides_count else [])}


DP_SECRET_FILE = '.dp_secret'
SECRET_BITS = 128  # of the operating system's entropy; every key is derived from all of them (`federation.secret_key`)


class TrainingDiverged(ConfigError):
  """The loss became NaN/inf; the message names the flags that can cause it (`diverged_message`)."""


def diverged_message(cfg: ExperimentConfig, round_index: int, loss: float, budget=None) -> str:
  """Why a run's loss became NaN/inf in round `round_index` (0-based) and what to change: under DP first the noise
  the clients receive (sigma * C in every coordinate of what they are sent back) and the clip, else the learning
  rates."""
  head = f'training diverged in round {round_index + 1} (train_loss={loss}). '
  tail = ' Start again in a new --workdir; a diverged run cannot be resumed with other settings.'
  rates = (f'a lower --local_learning_rate (now {cfg.local_learning_rate}) or the method\'s server/learning-rate '
           f'flags')
  if cfg.dp_mode == 'off' or budget is None:
    return head + f'Fix: {rates}.' + tail
  noise = budget.noise_multiplier * cfg.dp_clip
  return (head + f'Under --dp_mode={cfg.dp_mode} the noise on what the server averages has standard deviation '
          f'sigma * C = {budget.noise_multiplier:.4g} * {cfg.dp_clip:g} = {noise:.4g} per coordinate. Fix: less noise '
          f'(a larger --dp_target_epsilon or a smaller --dp_noise_multiplier), a smaller --dp_clip (now '
          f'{cfg.dp_clip:g}) if the noise is large against the uploads, or else {rates}.' + tail)


def resumable_fields(run: Run, cfg: Optional[ExperimentConfig] = None) -> tuple[str, ...]:
  """The config fields a resume may change for this run: not --rounds when the method's numbers depend on it, nor
  when the DP noise is calibrated to the whole run (--dp_target_epsilon)."""
  fixed_length = run.depends_on_rounds or (cfg is not None and cfg.dp_mode != 'off' and cfg.dp_target_epsilon > 0)
  return tuple(f for f in resumable_settings() if not (f == 'rounds' and fixed_length))


def run_identity(cfg: ExperimentConfig, fed: Federation, run: Run) -> dict:
  """What identifies a run, saved with each checkpoint: every setting its numbers depend on, and a digest of its
  partition (class counts per client), which also catches a dataset file changed under the same name."""
  counts = np.concatenate([fed.data.split.train_class_counts, fed.data.split.test_class_counts]).astype(np.int64)
  settings = {k: v for k, v in cfg.to_dict().items() if k not in resumable_fields(run, cfg)}
  return {'settings': json.loads(json.dumps(settings)), 'partition': hashlib.sha256(counts.tobytes()).hexdigest()}


def _by_flag(settings: dict) -> dict:
  """Run settings with the method's hyperparameters ('methods': {name: {field: value}}) as one entry per flag,
  so a changed one is named by itself."""
  out = {k: v for k, v in settings.items() if k != 'methods'}
  for name, values in (settings.get('methods') or {}).items():
    flags = config_flags(name) if name in METHODS else {}
    out.update({flags.get(field, f'{name}.{field}'): value for field, value in values.items()})
  return out


def _refuse_changed(before: dict, after: dict, where: str) -> None:
  """A ConfigError naming the settings that differ between `before` (saved in `where`) and `after` (now)."""
  before, after = _by_flag(before), _by_flag(after)
  changed = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
  if changed:
    diffs = ', '.join(f'{k} ({before.get(k)!r} there, {after.get(k)!r} now)' for k in changed[:6])
    raise ConfigError(f'--resume: {where} was written by a run with different settings for {diffs}. Fix: resume '
                      f'with the same flags, or use a new --workdir.')


def _check_identity(saved: dict, now: dict, where: str, run: Run) -> None:
  """Refuses to resume from a checkpoint of another run (ConfigError naming the settings that differ)."""
  before, after = run_settings(saved.get('settings', {})), run_settings(now['settings'])
  if before.get('rounds') != after.get('rounds') and run.depends_on_rounds:
    raise ConfigError(f'--resume with --rounds={after["rounds"]}: this method\'s schedule spans the run\'s length '
                      f'(--rounds={before.get("rounds")} when it started), so its numbers would match neither run. '
                      f'Fix: resume with --rounds={before.get("rounds")}, or start a new run in a new --workdir.')
  _refuse_changed(before, after, where)
  if saved.get('partition') != now['partition']:
    raise ConfigError(f'--resume: {where} was written for another partition of the data (the dataset changed under '
                      f'the same name?). Fix: use a new --workdir.')


def _check_config_json(workdir: Workdir, cfg: ExperimentConfig) -> None:
  """The cheap check before any data is loaded: config.json against the flags (the checkpoint's identity is the
  authoritative check, after the build)."""
  saved = workdir.read_json('config.json')
  if saved is None:
    return
  now = json.loads(json.dumps(cfg.to_dict()))
  fixed = lambda d: {k: v for k, v in run_settings(d).items() if k not in resumable_settings()}
  _refuse_changed(fixed(saved), fixed(now), workdir.file('config.json'))


def resumed_changes(workdir: Workdir, cfg: ExperimentConfig) -> list[str]:
  """The settings a resume changes against the run's config.json, as '--flag=old -> new' (only the resumable ones
  can differ: the others are refused)."""
  saved = workdir.read_json('config.json')
  if saved is None:
    return []
  before, now = run_settings(saved), run_settings(json.loads(json.dumps(cfg.to_dict())))
  show = lambda v: ','.join(map(str, v)) if isinstance(v, list) else v
  return [f'--{k}={show(before.get(k))} -> {show(now.get(k))}' for k in resumable_settings()
          if before.get(k) != now.get(k)]


def best_per_architecture_mean(cfg: ExperimentConfig, evals: list[dict]) -> Optional[float]:
  """The mean over architectures of each architecture's best (over the evaluation rounds) mean accuracy of its
  clients ("GeFL: Model-Agnostic Federated Learning with Generative Models", Sec. V: every architecture's model,
  best over rounds, then the mean); None without per-client accuracies."""
  rows = [np.asarray(r['client_accuracy']) for r in evals if r.get('client_accuracy')]
  if not rows:
    return None
  archs = np.asarray(cfg.model_config().architectures(cfg.num_clients))
  best = [max(float(r[archs == a].mean()) for r in rows) for a in dict.fromkeys(archs)]
  return float(np.mean(best))


def restore_run(workdir: str, flag: str = '--workdir'):
  """(config, federation, state at its latest checkpoint) of the run in `workdir`, or a ConfigError naming `flag`
  (for tools that read a finished run: experiments/mnd.py, experiments/invert.py)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise ConfigError(f'{flag}={workdir} holds no config.json: give the folder of a run.')
  with open(path) as f:
    cfg = ExperimentConfig.from_dict(json.load(f))
  fed = build_federation(cfg)
  checkpoints = Checkpoints(os.path.join(workdir, 'checkpoints'))
  if checkpoints.latest_round() is None:
    raise ConfigError(f'{flag}={workdir} holds no checkpoint to read.')
  state, _ = checkpoints.restore_latest(fed.init())
  return cfg, fed, state


def second_half_mean(evals: list[dict]) -> Optional[float]:
  """The mean accuracy over the evaluations after half of the run's rounds (Felo/Velo, "Exploiting Features and Logits
  in Heterogeneous Federated Learning": "the average accuracy after half of the training process"); None without
  evaluations."""
  if not evals:
    return None
  half = evals[-1]['round'] / 2
  return float(np.mean([r['accuracy'] for r in evals if r['round'] > half]))


def _over_rows(rows: list[dict], key: str, reduce: Callable) -> Optional[float]:
  """reduce(the rows' values of `key`), or None where no row holds it; 0.0 for a run without rows."""
  values = [r[key] for r in rows if key in r]
  if not rows:
    return 0.0
  return float(reduce(values)) if values else None


def summarize(cfg: ExperimentConfig, rows: list[dict], seconds: float, dp: Optional[dict] = None) -> dict:
  """summary.json: final and best accuracy, communication per round, the privacy spent under DP (with `dp`, what
  its epsilon means: `PrivacyBudget.describe`) and the full config."""
  evals = [r for r in rows if 'accuracy' in r]
  best = max(evals, key=lambda r: r['accuracy']) if evals else None
  last = evals[-1] if evals else {}
  return {
      'final_accuracy': last.get('accuracy'),
      'final_client_accuracy_mean': last.get('client_accuracy_mean'),
      'final_client_accuracy_std': last.get('client_accuracy_std'),
      'final_local_head_accuracy': last.get('local_head_accuracy'),
      'best_accuracy': best['accuracy'] if best else None,
      # GeFL's reported number: per architecture its clients' best mean accuracy over the evaluations, averaged
      'best_accuracy_per_architecture_mean': best_per_architecture_mean(cfg, evals),
      'best_round': best['round'] if best else None,
      # Felo / Velo's reported number: the mean accuracy of the evaluations in the second half of the run
      'second_half_mean_accuracy': second_half_mean(evals),
      'rounds': rows[-1]['round'] if rows else 0,
      # per round and totals over the run (every phase, e.g. FedVTC's psi exchange), scalars and fp32 bytes; None
      # where the rows withhold them (DP that counts on a secret Poisson draw: they tell how many were drawn)
      **{f'{d}_scalars_per_round': _over_rows(rows, f'{d}_scalars', np.mean) for d in ('upload', 'broadcast')},
      **{f'{d}_{unit}_total': _over_rows(rows, f'{d}_{unit}', lambda v: int(np.sum(v)))
         for d in ('upload', 'broadcast') for unit in ('scalars', 'bytes')},
      'seconds': seconds,
      # the last accuracy of each phase, for methods of several (FedVTC: before / after fine-tuning)
      'final_accuracy_by_phase': {r['phase']: r['accuracy'] for r in evals} if len({r['phase'] for r in evals}) > 1
                                 else None,
      # client-level DP (--dp_mode): the epsilon spent at delta by the rounds done, and the noise that spent it
      'dp': ({'mode': cfg.dp_mode, 'epsilon': rows[-1]['dp_epsilon'], 'delta': rows[-1]['dp_delta'],
              'noise_multiplier': rows[-1]['dp_noise_multiplier'], 'clip': cfg.dp_clip,
              'accountant': cfg.dp_accountant, **(dp or {})} if rows and 'dp_epsilon' in rows[-1] else None),
      'config': cfg.to_dict(),
  }


def train_and_evaluate(cfg: ExperimentConfig, workdir: str, resume: bool = False, progress: bool = True,
                       tensorboard: bool = False, federation: Optional[Callable[[Federation], Any]] = None,
                       say: Optional[Callable[[str], None]] = None) -> dict:
  """Runs the configured rounds (`cfg.rounds`, plus any closing phases of fixed length the method appends, e.g.
  FedVTC's; continuing from the last checkpoint with `resume`) and writes the workdir outputs (process 0 of a
  multi-process run, `fedjax_het.run.distributed`; with
  `tensorboard`, also each round's scalars as TensorBoard events in tensorboard/, `fedjax_het.run.tensorboard`).

  `federation`, when given, wraps the built `Federation` into what runs the rounds (its `init`, `round` and
  `evaluate`; `flower.rounds.FlowerRounds` runs them on Flower nodes).

  With `progress`, process 0 says on stderr what the start does (loading, initialising, compiling) and shows a bar;
  without it, `say`, when given, gets those lines (a Flower ServerApp streams them to `flwr run`), and no bar.

  Returns the summary dict (also written to summary.json). Raises `ConfigError` for bad input (nothing written
  over an existing run), `TrainingDiverged`, and `interrupts.Interrupted` after a stop request (SIGINT/SIGTERM),
  which finishes the current round, checkpoints it and keeps every output.
  """
  if tensorboard:
    summary_writer_class()  # a missing package fails before anything is written
  with StopAtRoundEnd() as stop, Workdir(workdir, writes=distributed.is_writer()).open(resume) as wd:
    distributed.barrier('workdir checked')  # every process checks the folder before the first writes to it
    events = wd.file(TENSORBOARD_FOLDER)
    if tensorboard and os.path.lexists(events) and not os.path.isdir(events):
      raise ConfigError(f'--tensorboard: {events} exists and is not a folder, so the events cannot go there. Fix: '
                        f'move that file away, or leave --tensorboard off.')
    changes = []
    if resume:
      _check_config_json(wd, cfg)
      changes = resumed_changes(wd, cfg)
    if _stopping(stop):
      raise Interrupted(stop.requested or 'SIGTERM', resume, 0)
    lines = say if say is not None and distributed.is_writer() else (lambda text: None)
    say = (lambda text: sys.stderr.write(f'{cfg.algorithm}: {text}\n')) if progress and distributed.is_writer() else (
        lambda text: lines(f'{cfg.algorithm}: {text}'))
    calibrating = (f', then calibrating the DP noise to --dp_target_epsilon={cfg.dp_target_epsilon:g}'
                   if cfg.dp_mode != 'off' and cfg.dp_target_epsilon > 0 else '')
    say(f'loading {cfg.dataset} and splitting it over {cfg.num_clients} clients ({cfg.partition}){calibrating}')
    fed, run, budget = _build(cfg, dp_secret(cfg, wd, resume), _startup_check(stop, resume))
    say(f'running on {fed.execution.describe()}')  # the defaults are the backend's where a flag leaves them unset
    startup = StartupDisplay(fed, say) if progress and distributed.is_writer() else None
    if startup is None:  # the lines alone (`say`), no bar
      say(f'initialising {len(fed.groups)} architecture group(s) ({", ".join(g.arch for g in fed.groups)})')
    if federation is not None:
      fed = federation(fed)
    if _stopping(stop):
      raise Interrupted(stop.requested or 'SIGTERM', resume, 0)  # stopped during startup: nothing written
    identity = run_identity(cfg, fed, run)
    has_checkpoints = wd.has_checkpoints()
    checkpoints = Checkpoints(wd.checkpoints) if cfg.checkpoint_every or (resume and has_checkpoints) else None
    state, rows = fed.init(), []
    if startup is not None:
      startup.initialised()
    if resume:
      if not has_checkpoints:
        raise ConfigError(_no_checkpoint_message(wd))
      where = f'the checkpoint under {wd.checkpoints}'
      state, _ = checkpoints.restore_latest(state, lambda saved: _check_identity(saved, identity, where, run))
      rows = _resumed_rows(wd, checkpoints, int(state.round))
      say(f'resumed {wd.path} from its checkpoint of round {int(state.round)}; '
          + (f'changed since config.json: {", ".join(changes)}' if changes else 'no setting changed'))
    if _stopping(stop):  # stopped while restoring: nothing new written
      raise Interrupted(stop.requested or 'SIGTERM', resume, int(state.round))
    wd.write_json('config.json', cfg.to_dict())
    wd.write_json('partition.json', {'architectures': fed.architectures,
                                     'train_class_counts': fed.data.split.train_class_counts.tolist(),
                                     'test_class_counts': fed.data.split.test_class_counts.tolist()})
    counts = fed.data.split.train_class_counts + fed.data.split.test_class_counts
    if wd.writes:
      plot_partition(counts, wd.file('partition.png'), f'{cfg.partition} partition of {cfg.dataset}')
    logging.info('Partition (clients x classes), samples per client: %s', counts.sum(1).tolist())
    wd.write_metrics(rows)
    scalars = (ScalarLog(wd.file(TENSORBOARD_FOLDER), resumed_after=int(state.round)) if tensorboard and wd.writes
               else None)
    if budget is not None and rows:  # the rounds that ran are accounted as they ran (their participants)
      budget = budget.after(rows)
    return _train(cfg, fed, state, rows, wd, checkpoints if cfg.checkpoint_every else None, identity, stop,
                  progress, scalars, budget, startup)


def _startup_check(stop: StopAtRoundEnd, resume: bool) -> Callable[[], None]:
  """What the startup's long Python work (the DP noise's calibration) calls between its steps: a stop request
  ends it there with `Interrupted`, before anything is written, as one during the rest of the startup does once
  the federation is built. In a run over several processes it does nothing: they stop together after the build
  (`_stopping`), so that none waits in a collective for one that left."""
  def check() -> None:
    if stop.requested is not None and jax.process_count() == 1:
      raise Interrupted(stop.requested, resume, 0)
  return check


def _stopping(stop: StopAtRoundEnd) -> bool:
  """Whether a stop was requested, in any process of the run: all of them stop at the same point."""
  return distributed.any_process(stop.requested is not None)


def _no_checkpoint_message(wd: Workdir) -> str:
  """Why --resume cannot go on in a workdir without checkpoints, and the way out that works there."""
  if wd.holds_run():  # a run without checkpoints (--checkpoint_every=0, or stopped before its first)
    return (f'--resume: the run in --workdir={wd.path} wrote no checkpoint (--checkpoint_every=0, or it stopped '
            f'before its first), so it cannot be continued. Fix: start it again in a new --workdir, or after deleting '
            f'{wd.path} (with --checkpoint_every > 0 to make it resumable).')
  return (f'--resume: no checkpoint under {wd.checkpoints}. Fix: drop --resume to start a new run (with '
          f'--checkpoint_every > 0 to make it resumable).')


def _resumed_rows(wd: Workdir, checkpoints: Checkpoints, saved_round: int) -> list[dict]:
  """The metrics rows of rounds 1..saved_round: metrics.jsonl's, or, where it lacks some (deleted, cut short),
  the copy saved in the checkpoint; a ConfigError when neither holds them all (the summary would be wrong)."""
  rows = wd.read_metrics(saved_round)
  if [r.get('round') for r in rows] == list(range(1, saved_round + 1)):
    return rows
  saved = checkpoints.metrics(saved_round)
  if saved is not None and [r.get('round') for r in saved] == list(range(1, saved_round + 1)):
    logging.warning('%s holds %d of the %d rounds the checkpoint follows; rebuilt it from the checkpoint\'s copy.',
                    wd.file('metrics.jsonl'), len(rows), saved_round)
    return saved
  raise ConfigError(f'--resume: {wd.file("metrics.jsonl")} holds {len(rows)} of the {saved_round} rounds the '
                    f'checkpoint follows, and the checkpoint carries no copy of them, so the summary of the run would '
                    f'be wrong. Fix: put back the metrics.jsonl of this run, or start it again in a new --workdir.')


def _train(cfg, fed, state, rows, wd: Workdir, checkpoints, identity, stop, progress, scalars=None,
           budget=None, startup: Optional['StartupDisplay'] = None) -> dict:
  """The round loop from `state` to the run's last round; outputs are finished (summary.json, plot) however it
  ends."""
  total = fed.total_rounds
  start_round = int(state.round)
  start = time.perf_counter() - (rows[-1].get('elapsed_seconds', 0.0) if rows else 0.0)
  saved_round = checkpoints.latest_round() if checkpoints is not None else None
  idle = fed.clients_without_steps
  bar = sampler = None
  # On a terminal (or in a notebook) a bar; where stderr is a file, a line per round (a bar's redraws would fill it).
  lines = progress and not wants_progress_bar()
  if progress and not lines:
    from tqdm.auto import tqdm
    bar = tqdm(total=total, initial=start_round, desc=f'{cfg.algorithm}', unit='round',
               # under DP no per-round timing in what the run prints either (`released_metrics`)
               bar_format=None if budget is None else '{desc}: {n_fmt}/{total_fmt} rounds{postfix}')
  try:
    for r in range(start_round, total):
      if startup is not None:
        startup.before_round(r)
      state, metrics = fed.round(state)
      if startup is not None:
        startup.after_round()
      loss = metrics.get('train_loss', 0.0)  # none in a round that drew nobody
      if fed.evaluates_after(r, cfg.eval_every):
        t0 = time.perf_counter()
        if startup is not None:
          startup.before_evaluation(r)
        metrics.update(fed.evaluate(state))
        if startup is not None:
          startup.after_round()
        metrics['eval_seconds'] = time.perf_counter() - t0
        if fed.algorithm.samples is not None:
          sampler = sampler or _sampler(fed)
          samples = sampler(state.server)  # in every process: each runs every computation of the run
          if wd.writes:
            plot_samples(samples, real_examples(fed.data.dataset, SAMPLES_PER_CLASS), wd.file('samples.png'),
                         f'{cfg.algorithm} on {cfg.dataset}, round {r + 1}')
      metrics['elapsed_seconds'] = time.perf_counter() - start
      if budget is not None:
        metrics = released_metrics(metrics, budget)
        metrics.update(budget.metrics(r + 1))
      rows.append(metrics)
      wd.append_metrics(metrics)
      if scalars is not None:
        scalars.write(metrics)
      if not np.isfinite(loss):
        raise TrainingDiverged(diverged_message(cfg, r, loss, budget))
      due = (r + 1) % max(cfg.checkpoint_every, 1) == 0 or r + 1 == total
      stopping = _stopping(stop)
      if checkpoints is not None and (due or stopping):
        checkpoints.save(state, identity, rows)
        saved_round = r + 1
      if bar is not None or lines:
        postfix = {'loss': f"{metrics['train_loss']:.3f}"} if 'train_loss' in metrics else {}
        if 'accuracy' in metrics:
          postfix['acc'] = f"{100 * metrics['accuracy']:.2f}"
        if idle:
          postfix['no_step'] = f'{len(idle)} clients'
        if bar is not None:
          bar.update(1)
          bar.set_postfix(postfix)
        else:
          took = f' ({metrics["train_seconds"]:.2f} s)' if budget is None and 'train_seconds' in metrics else ''
          sys.stderr.write(f'{cfg.algorithm}: round {r + 1}/{total}{took}: '
                           f'{", ".join(f"{k}={v}" for k, v in postfix.items())}\n')
      if stopping:
        raise Interrupted(stop.requested or 'SIGTERM', saved_round is not None, r + 1)
  except TrainingDiverged:
    # a final state, recorded as such
    _finish(cfg, wd, rows, start, idle, total, diverged_round=len(rows), budget=budget)
    raise
  except (KeyboardInterrupt, ConfigError):
    _finish(cfg, wd, rows, start, idle, total, budget=budget)  # keep the summary and plot of the rounds done
    raise
  except OSError as e:  # metrics.jsonl could not be appended: a full disk, a removed folder
    _finish(cfg, wd, rows, start, idle, total, budget=budget)
    failed = f'writing the outputs of round {len(rows)} in --workdir={wd.path} failed ({e.strerror or e}).'
    if saved_round is None:
      raise ConfigError(f'{failed} The run wrote no checkpoint (--checkpoint_every=0, or before its first), so it '
                        f'cannot be continued. Fix the cause (free disk space), then start it again in a new '
                        f'--workdir, or after deleting {wd.path}.') from None
    raise ConfigError(f'{failed} Fix the cause (free disk space), then continue from the checkpoint of round '
                      f'{saved_round} with --resume.') from None
  finally:
    if bar is not None:
      bar.close()
    if scalars is not None:
      scalars.close()
  return _finish(cfg, wd, rows, start, idle, total, budget=budget)


class StartupDisplay:
  """What a run prints while it starts: a bar over the architecture groups as their programs compile, at
  initialisation, in the first round of each phase (where every group compiles its round programs; then the
  server step, named on the bar) and at its first evaluation (each evaluation set's programs), and where XLA's
  compilation cache keeps them for the next start."""

  def __init__(self, fed: Federation, say: Callable[[str], None]):
    from fedjax_het.run.compilation_cache import configured_directory
    self.fed, self.say, self.bar = fed, say, None
    self.lines = not wants_progress_bar()  # stderr a file: a line as each compilation starts, not a bar
    self.compiled_phases: set = set()
    self.evaluated_phases: set = set()
    cache = configured_directory()
    self.cache_note = (f'compiled programs go into XLA\'s compilation cache ({cache}), so the next start of this '
                       'setting skips most of it' if cache else 'XLA\'s compilation cache is off '
                       '(--compilation_cache): every start compiles again')
    self.say(f'initialising {len(fed.groups)} architecture group(s) '
             f'({", ".join(g.arch for g in fed.groups)}); {self.cache_note}')
    self._open('initialising', 'init')

  def _open(self, what: str, kind: str, passes: int = 1, then: str = '') -> None:
    """A bar over `passes` calls of every group reporting `kind`; `then` names what runs after the last. Where
    stderr is a file, one line instead."""
    if self.lines:  # initialising: said already as the display starts
      if kind != 'init':
        self.say(f'{what} ({len(self.fed.groups)} architecture group(s){", then " + then if then else ""})')
      return
    from tqdm.auto import tqdm
    self.bar = tqdm(total=len(self.fed.groups) * passes, desc=f'{self.fed.algorithm.name}: {what}', unit='group',
                    leave=False)

    def progress(k, gi, total):
      if k == kind and self.bar is not None:
        self.bar.update(1)
        if then and self.bar.n == self.bar.total:
          self.bar.set_postfix_str(then, refresh=True)
    self.fed.progress = progress

  def _close(self) -> None:
    if self.bar is not None:
      self.bar.close()
    self.bar, self.fed.progress = None, None

  def initialised(self) -> None:
    """Closes the initialisation bar."""
    self._close()

  def before_round(self, round_index: int) -> None:
    """Opens a bar over the groups where round `round_index` is the first of its phase in this process (its
    programs compile now)."""
    phase = self.fed.phase_index(round_index)
    if phase not in self.compiled_phases:
      self.compiled_phases.add(phase)
      name = self.fed.algorithm.phases[phase].name
      self._open(f'compiling round {round_index + 1} ({name})', 'round', then='the server step')

  def before_evaluation(self, round_index: int) -> None:
    """Opens a bar over the groups' evaluation sets where this is the first evaluation of round `round_index`'s
    phase in this process (its programs compile now)."""
    phase = self.fed.phase_index(round_index)
    if phase not in self.evaluated_phases:
      self.evaluated_phases.add(phase)
      sets = int(self.fed.has_local_test) + int(self.fed.global_test is not None)
      self._open('compiling the evaluation', 'evaluate', passes=max(sets, 1))

  def after_round(self) -> None:
    """Closes the compile bar, if any (after a round or an evaluation)."""
    self._close()


SAMPLES_PER_CLASS = 8


def _sampler(fed: Federation):
  """The algorithm's `samples` for the server state, jitted once: SAMPLES_PER_CLASS images per class."""
  key = jax.random.PRNGKey(fed.seed)
  return jax.jit(lambda server: fed.algorithm.samples(server, fed.spec, key, SAMPLES_PER_CLASS))


def real_examples(dataset, per_class: int) -> np.ndarray:
  """The first `per_class` training images of every class [C, per_class, H, W, ch] (black where a class has
  fewer)."""
  out = np.full((dataset.num_classes, per_class) + dataset.image_shape, -1.0, np.float32)
  for c in range(dataset.num_classes):
    rows = np.flatnonzero(dataset.y == c)[:per_class]
    out[c, :len(rows)] = dataset.x[rows]
  return out


def _finish(cfg: ExperimentConfig, wd: Workdir, rows: list[dict], start: float, idle: list[int], total: int,
            diverged_round: Optional[int] = None, budget=None) -> dict:
  """Writes summary.json and accuracy.png for the rounds done so far (`diverged_round`: the round whose loss became
  NaN/inf, which ended the run); returns the summary. A failure to write (a full disk) is logged, never allowed to
  hide the error that ended the run."""
  summary = summarize(cfg, rows, time.perf_counter() - start,
                      {**budget.describe(), **release_policy(budget)} if budget is not None else None)
  summary['clients_without_local_steps'] = idle
  summary['finished'] = bool(rows) and rows[-1]['round'] == total
  summary['diverged_round'] = diverged_round
  try:
    wd.write_json('summary.json', summary)
    if wd.writes and any('accuracy' in r for r in rows):
      plot_accuracy(rows, wd.file('accuracy.png'), f'{cfg.algorithm} on {cfg.dataset}',
                    cfg.model_config().architectures(cfg.num_clients))
  except OSError as e:
    logging.error('could not write summary.json / accuracy.png in %s: %s', wd.path, e)
  return summary
