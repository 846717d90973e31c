"""Train and evaluate one configuration: the round loop, metrics.jsonl, summary.json, a plot, orbax checkpoints
and resume.

Workdir layout: config.json, partition.json and partition.png (class counts per client), metrics.jsonl (one line
per round), summary.json, accuracy.png, checkpoints/ (orbax CheckpointManager, one step per checkpointed round).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Optional

import jax
import numpy as np
from absl import logging

from fedjax_het.core import Algorithm
from fedjax_het.config import ExperimentConfig
from fedjax_het.data.datasets import load_dataset
from fedjax_het.data.federated import FederatedData, make_federated_data
from fedjax_het.engine.federation import Federation, FederationState, default_conv, default_strategy
from fedjax_het.engine.sharding import client_mesh
from fedjax_het.errors import ConfigError
from fedjax_het.methods import Run, method
from fedjax_het.models.registry import assign_models

# Config fields that may change when a run is resumed (they do not change the numbers of completed rounds).
RESUMABLE_FIELDS = ('rounds', 'checkpoint_every', 'strategy', 'chunk_size', 'eval_batch_size', 'data_dir', 'conv',
                    'scan_unroll', 'num_devices', 'client_threads')


def make_algorithm(cfg: ExperimentConfig, data: FederatedData) -> Algorithm:
  """The `Algorithm` named by --algorithm (`fedjax_het.methods`), with its hyperparameters from the config."""
  run = Run(data.num_classes, cfg.num_clients, cfg.rounds, cfg.feature_dim, cfg.batch_size, cfg.local_learning_rate,
            lambda: data.loader_label_counts(cfg.batch_size, cfg.data_order == 'stored'))
  return method(cfg.algorithm).build(cfg.methods[cfg.algorithm], run)


def build_federation(cfg: ExperimentConfig) -> Federation:
  """Dataset -> partition -> groups -> `Federation`, all from the config and its seed."""
  if cfg.rounds < 0:
    raise ConfigError(f'--rounds={cfg.rounds} must be >= 0.')
  if cfg.eval_every < 1 or cfg.checkpoint_every < 0:
    raise ConfigError('--eval_every must be >= 1 and --checkpoint_every >= 0 (0 disables checkpoints).')
  method(cfg.algorithm)  # an unknown method fails before any data is loaded
  assign_models(cfg.models, cfg.num_clients)
  dataset = load_dataset(cfg.dataset, cfg.data_dir, seed=cfg.seed)
  data = make_federated_data(dataset, cfg.num_clients, cfg.partition, cfg.seed, cfg.eval_protocol,
                             alpha=cfg.alpha, classes_per_client=cfg.classes_per_client, balance=cfg.balance,
                             imbalance_factor=cfg.imbalance_factor, train_fraction=cfg.train_fraction)
  strategy = cfg.strategy or default_strategy()
  mesh = None
  if cfg.num_devices != 1 and (cfg.num_devices > 1 or strategy == 'vmap'):
    mesh = client_mesh(cfg.num_devices)
  return Federation(make_algorithm(cfg, data), data, cfg.models, cfg.local_training(),
                    feature_dim=cfg.feature_dim, rm=cfg.rm, strategy=strategy, join_ratio=cfg.join_ratio,
                    seed=cfg.seed, chunk_size=cfg.chunk_size, eval_batch_size=cfg.eval_batch_size,
                    conv=cfg.conv or default_conv(strategy), scan_unroll=cfg.scan_unroll, client_mesh=mesh,
                    client_threads=cfg.client_threads, init=cfg.init, shared_init=cfg.shared_init,
                    rounds=cfg.rounds)


class StopAtRoundEnd:
  """Context manager: the first Ctrl-C (SIGINT) asks the loop to stop after the current round, so that round is
  checkpointed (rounds donate their input buffers, so a state cannot be saved from inside one); a second Ctrl-C
  aborts at once. Outside the main thread signals cannot be caught and this does nothing."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame):
    if self.requested:
      raise KeyboardInterrupt
    self.requested = True
    logging.warning('Interrupted: finishing this round, then checkpointing and stopping. Interrupt again to abort '
                    'now (the last periodic checkpoint then stands).')

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)


class TrainingDiverged(ConfigError):
  """The loss became NaN/inf; the message names the learning-rate flags."""


class Checkpoints:
  """Orbax checkpoints of the `FederationState` leaves, restored into the structure of a fresh state."""

  def __init__(self, directory: str, max_to_keep: int = 2):
    import orbax.checkpoint as ocp  # Lazy: orbax is slow to import and only runs with checkpoints need it.
    self._ocp = ocp
    self.manager = ocp.CheckpointManager(os.path.abspath(directory),
                                         options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))

  def latest_round(self) -> Optional[int]:
    """The round of the newest checkpoint, or None."""
    return self.manager.latest_step()

  def save(self, state: FederationState) -> None:
    """Saves the state under its round number and waits until it is on disk."""
    leaves = {str(i): np.asarray(leaf) for i, leaf in enumerate(jax.tree.leaves(state))}
    self.manager.save(int(state.round), args=self._ocp.args.StandardSave(leaves))
    self.manager.wait_until_finished()

  def restore(self, template: FederationState, step: int) -> FederationState:
    """The state saved at `step`, in the pytree structure and device placement (sharding) of `template`, a
    freshly initialised state."""
    leaves, treedef = jax.tree.flatten(template)
    target = {str(i): np.zeros(np.shape(l), np.asarray(l).dtype) for i, l in enumerate(leaves)}
    restored = self.manager.restore(step, args=self._ocp.args.StandardRestore(target))
    # Sharded leaves go back to their devices; single-device ones stay uncommitted, as in a fresh state.
    place = lambda x, leaf: (jax.device_put(x, leaf.sharding) if len(leaf.sharding.device_set) > 1
                             else jax.numpy.asarray(x))
    return jax.tree.unflatten(treedef, [place(restored[str(i)], leaf) for i, leaf in enumerate(leaves)])


def holds_run(workdir: str) -> bool:
  """Whether `workdir` holds the outputs of a run: a metrics.jsonl or a non-empty checkpoints/ folder."""
  checkpoints = os.path.join(workdir, 'checkpoints')
  return (os.path.exists(os.path.join(workdir, 'metrics.jsonl'))
          or (os.path.isdir(checkpoints) and bool(os.listdir(checkpoints))))


def _read_metrics(path: str, upto_round: int) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if r['round'] <= upto_round]


def _write_metrics(path: str, rows: list[dict]) -> None:
  with open(path, 'w') as f:
    for r in rows:
      f.write(json.dumps(r) + '\n')


def _check_resumable(workdir: str, cfg: ExperimentConfig) -> None:
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    return
  with open(path) as f:
    saved = json.load(f)
  now = cfg.to_dict()
  changed = [k for k in now if k not in RESUMABLE_FIELDS and saved.get(k) != now[k]]
  if changed:
    raise ConfigError(f'--resume: {os.path.join(workdir, "config.json")} was written with different settings for '
                      f'{", ".join(changed)}. Fix: resume with the same flags, or use a new --workdir.')


def plot_accuracy(rows: list[dict], path: str, title: str) -> None:
  """Accuracy (and the local-head accuracy where logged) against round, as a PNG."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  rows = [r for r in rows if 'accuracy' in r]
  ax.plot([r['round'] for r in rows], [100 * r['accuracy'] for r in rows], label=rows[0]['eval_head'] if rows else '')
  if rows and 'local_head_accuracy' in rows[0]:
    ax.plot([r['round'] for r in rows], [100 * r['local_head_accuracy'] for r in rows], '--', label='local_head')
  ax.set_xlabel('round')
  ax.set_ylabel('test accuracy (%)')
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_partition(counts: np.ndarray, path: str, title: str) -> None:
  """Bubble chart of the partition: one circle per (client, class), its area proportional to the sample count."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  clients, classes = np.nonzero(counts)
  fig, ax = plt.subplots(figsize=(max(4, 0.4 * counts.shape[0]), max(3, 0.25 * counts.shape[1])))
  ax.scatter(clients, classes, s=300 * counts[clients, classes] / max(counts.max(), 1), alpha=0.6)
  ax.set_xlabel('client')
  ax.set_ylabel('class')
  ax.set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def summarize(cfg: ExperimentConfig, rows: list[dict], seconds: float) -> dict:
  """summary.json: final and best accuracy, communication per round, and the full config."""
  evals = [r for r in rows if 'accuracy' in r]
  best = max(evals, key=lambda r: r['accuracy']) if evals else None
  last = evals[-1] if evals else {}
  return {
      'final_accuracy': last.get('accuracy'),
      'final_client_accuracy_mean': last.get('client_accuracy_mean'),
      'final_client_accuracy_std': last.get('client_accuracy_std'),
      'final_local_head_accuracy': last.get('local_head_accuracy'),
      'best_accuracy': best['accuracy'] if best else None,
      'best_round': best['round'] if best else None,
      'rounds': rows[-1]['round'] if rows else 0,
      'upload_scalars_per_round': float(np.mean([r['upload_scalars'] for r in rows])) if rows else 0.0,
      'broadcast_scalars_per_round': float(np.mean([r['broadcast_scalars'] for r in rows])) if rows else 0.0,
      'seconds': seconds,
      'config': cfg.to_dict(),
  }


def train_and_evaluate(cfg: ExperimentConfig, workdir: str, resume: bool = False, progress: bool = True) -> dict:
  """Runs `cfg.rounds` rounds (continuing from the last checkpoint with `resume`) and writes the workdir outputs.

  Returns the summary dict (also written to summary.json).
  """
  if not resume and holds_run(workdir):
    raise ConfigError(f'--workdir={workdir} already holds a run (metrics.jsonl or checkpoints/); starting another '
                      f'there would overwrite its outputs. Fix: add --resume to continue that run, or choose a new '
                      f'--workdir.')
  os.makedirs(workdir, exist_ok=True)
  if resume:
    _check_resumable(workdir, cfg)
  fed = build_federation(cfg)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(cfg.to_dict(), f, indent=2)
  with open(os.path.join(workdir, 'partition.json'), 'w') as f:
    json.dump({'architectures': fed.architectures,
               'train_class_counts': fed.data.split.train_class_counts.tolist(),
               'test_class_counts': fed.data.split.test_class_counts.tolist()}, f)

  counts = fed.data.split.train_class_counts + fed.data.split.test_class_counts
  plot_partition(counts, os.path.join(workdir, 'partition.png'), f'{cfg.partition} partition of {cfg.dataset}')
  logging.info('Partition (clients x classes), samples per client: %s', counts.sum(1).tolist())

  state = fed.init()
  checkpoints = Checkpoints(os.path.join(workdir, 'checkpoints')) if cfg.checkpoint_every else None
  metrics_path = os.path.join(workdir, 'metrics.jsonl')
  rows: list[dict] = []
  if resume and checkpoints is not None and checkpoints.latest_round() is not None:
    state = checkpoints.restore(state, checkpoints.latest_round())
    rows = _read_metrics(metrics_path, int(state.round))
  elif resume:
    raise ConfigError(f'--resume: no checkpoint under {os.path.join(workdir, "checkpoints")}. Fix: drop --resume '
                      f'to start a new run (and set --checkpoint_every > 0 to make resumable runs).')
  _write_metrics(metrics_path, rows)

  start_round = int(state.round)
  start = time.perf_counter() - (rows[-1]['elapsed_seconds'] if rows else 0.0)
  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=cfg.rounds, initial=start_round, desc=f'{cfg.algorithm}', unit='round')
  try:
    with StopAtRoundEnd() as stop:
      for r in range(start_round, cfg.rounds):
        state, metrics = fed.round(state)
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
          t0 = time.perf_counter()
          metrics.update(fed.evaluate(state))
          metrics['eval_seconds'] = time.perf_counter() - t0
        metrics['elapsed_seconds'] = time.perf_counter() - start
        rows.append(metrics)
        with open(metrics_path, 'a') as f:
          f.write(json.dumps(metrics) + '\n')
        if not np.isfinite(metrics['train_loss']):
          raise TrainingDiverged(f'training diverged in round {r + 1} (train_loss={metrics["train_loss"]}). Fix: '
                                 f'lower --local_learning_rate (now {cfg.local_learning_rate}) or '
                                 f'--server_learning_rate.')
        due = (r + 1) % max(cfg.checkpoint_every, 1) == 0 or r + 1 == cfg.rounds
        if checkpoints is not None and (due or stop.requested):
          checkpoints.save(state)
        if bar is not None:
          bar.update(1)
          if 'accuracy' in metrics:
            bar.set_postfix(acc=f"{100 * metrics['accuracy']:.2f}", loss=f"{metrics['train_loss']:.3f}")
        if stop.requested:
          raise KeyboardInterrupt
  except (KeyboardInterrupt, TrainingDiverged):
    _finish(cfg, workdir, rows, start)  # keep the summary and plot of the rounds done
    raise
  finally:
    if bar is not None:
      bar.close()
  return _finish(cfg, workdir, rows, start)


def _finish(cfg: ExperimentConfig, workdir: str, rows: list[dict], start: float) -> dict:
  """Writes summary.json and accuracy.png for the rounds done so far; returns the summary."""
  summary = summarize(cfg, rows, time.perf_counter() - start)
  with open(os.path.join(workdir, 'summary.json'), 'w') as f:
    json.dump(summary, f, indent=2)
  if any('accuracy' in r for r in rows):
    plot_accuracy(rows, os.path.join(workdir, 'accuracy.png'), f'{cfg.algorithm} on {cfg.dataset}')
  return summary
