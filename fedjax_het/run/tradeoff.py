"""The privacy-utility trade-off: methods x target epsilons x seeds, each an ordinary run (`compare.run_comparison`
in `<workdir>/eps<epsilon>/`; epsilon 'inf' is the run without DP), a table of final accuracy against the epsilon
each run spent, and one plot with every method on the same axes."""

from __future__ import annotations

import dataclasses
import math
import os
import textwrap
from typing import Sequence

import numpy as np

from fedjax_het.errors import ConfigError
from fedjax_het.run.compare import MethodResult, diverged_note, run_comparison, write_outputs
from fedjax_het.run.config import ExperimentConfig
from fedjax_het.run.plots import save_line_plot
from fedjax_het.run.workdir import strict_json


@dataclasses.dataclass
class TradeoffPoint:
  """One method at one target epsilon (inf: without DP): its runs over the seeds."""
  algorithm: str
  epsilon: float
  result: MethodResult

  @property
  def accuracies(self) -> np.ndarray:
    """Final accuracy of each seed's run."""
    return np.asarray([s['final_accuracy'] for s in self.result.summaries], float)

  @property
  def spent(self) -> list:
    """The epsilon each seed's run spent (None without DP)."""
    return [(s.get('dp') or {}).get('epsilon') for s in self.result.summaries]


def epsilon_folder(epsilon: float) -> str:
  """The sub-folder of the runs at `epsilon`."""
  return 'eps_inf' if math.isinf(epsilon) else f'eps{epsilon:g}'


def run_tradeoff(base: ExperimentConfig, mode: str, algorithms: Sequence[str], epsilons: Sequence[float],
                 seeds: Sequence[int], workdir: str, progress: bool = True, baselines: Sequence[str] = (),
                 parts: Sequence[str] = ()) -> list[TradeoffPoint]:
  """Runs (or reuses, or resumes) every method of `base` (a config without DP) at every target epsilon in DP
  `mode` with `parts` (--dp_parts; inf: without DP) and every seed; each finite epsilon calibrates the noise to the
  whole run (--dp_target_epsilon). `baselines` run without DP only (e.g. 'local', which uploads nothing: the
  accuracy no knowledge from others gives)."""
  if mode not in ('central', 'local'):
    raise ConfigError(f'--dp_mode={mode}: the trade-off needs the mode its finite epsilons run in. Fix: '
                      f'--dp_mode=central or --dp_mode=local.')
  if base.dp_mode != 'off':
    raise ConfigError('run_tradeoff: its base config runs without DP (each point sets its own). Fix: '
                      'ExperimentConfig.dp_mode=\'off\'.')
  if not epsilons or any(not (e > 0) for e in epsilons):
    raise ConfigError(f'--epsilons={list(epsilons)} must be positive numbers (inf: without DP).')
  points = []
  for epsilon in epsilons:
    cfg = (base if math.isinf(epsilon) else dataclasses.replace(base, dp_mode=mode, dp_noise_multiplier=0.0,
                                                                 dp_target_epsilon=epsilon, dp_parts=parts))
    results = run_comparison(cfg, algorithms, seeds, os.path.join(workdir, epsilon_folder(epsilon)), progress)
    points += [TradeoffPoint(r.algorithm, epsilon, r) for r in results]
  if baselines:
    results = run_comparison(base, baselines, seeds, os.path.join(workdir, epsilon_folder(math.inf)), progress)
    points += [TradeoffPoint(r.algorithm, math.inf, r) for r in results]
  return points


def tradeoff_table(points: Sequence[TradeoffPoint]) -> str:
  """Markdown: one row per method, one column per epsilon: final accuracy (%), mean +- std over seeds."""
  epsilons = sorted({p.epsilon for p in points})
  by = {(p.algorithm, p.epsilon): p for p in points}
  header = ' | '.join('no DP' if math.isinf(e) else f'epsilon {e:g}' for e in epsilons)
  lines = [f'| method | {header} | seeds |', '|---|' + '---|' * len(epsilons) + '---|']
  for algorithm in dict.fromkeys(p.algorithm for p in points):
    cells = []
    for e in epsilons:
      acc = 100 * by[(algorithm, e)].accuracies if (algorithm, e) in by else None
      cells.append(f'{acc.mean():.2f} +- {acc.std():.2f}' if acc is not None else '')
    seeds = len(next(p for p in points if p.algorithm == algorithm).result.summaries)
    lines.append(f'| {algorithm} | ' + ' | '.join(cells) + f' | {seeds} |')
  gone = [(p.algorithm, p.epsilon, diverged_note(p.result.summaries)) for p in points
          if diverged_note(p.result.summaries)]
  if gone:
    lines += ['', 'Diverged (NaN/inf loss; counted with the accuracy of their last model): ' + '; '.join(
        f'{a} at {"no DP" if math.isinf(e) else f"epsilon {e:g}"}{d}' for a, e, d in gone) + '.']
  return '\n'.join(lines) + '\n'


def plot_tradeoff(points: Sequence[TradeoffPoint], path: str, title: str) -> None:
  """Final accuracy against epsilon (log axis; 'no DP' at the right), mean over seeds with min-max bars, one line
  per method; a baseline run only without DP is a dashed level."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  finite = sorted({p.epsilon for p in points if not math.isinf(p.epsilon)})
  no_dp_at = (finite[-1] * 4) if finite else 1.0
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for i, algorithm in enumerate(dict.fromkeys(p.algorithm for p in points)):
    mine = sorted((p for p in points if p.algorithm == algorithm), key=lambda p: p.epsilon)
    if len(mine) == 1 and math.isinf(mine[0].epsilon):  # a baseline without uploads: a level, not a curve
      ax.axhline(100 * mine[0].accuracies.mean(), color=f'C{i}', linestyle='--', label=f'{algorithm} (no DP)')
      continue
    x = [no_dp_at if math.isinf(p.epsilon) else p.epsilon for p in mine]
    acc = [100 * p.accuracies for p in mine]
    mean = np.asarray([a.mean() for a in acc])
    err = np.asarray([[m - a.min() for a, m in zip(acc, mean)], [a.max() - m for a, m in zip(acc, mean)]])
    ax.errorbar(x, mean, yerr=err, marker='o', capsize=3, label=algorithm, color=f'C{i}')
  ax.set_xscale('log')
  ticks = finite + [no_dp_at]
  ax.set_xticks(ticks)
  ax.set_xticklabels([f'{e:g}' for e in finite] + ['no DP'])
  ax.minorticks_off()
  save_line_plot(fig, ax, path, 'epsilon (client-level, at the run\'s delta)', 'final test accuracy (%)',
                 textwrap.fill(title, 80), title_size=9)


def write_tradeoff(points: Sequence[TradeoffPoint], workdir: str, title: str) -> str:
  """Writes privacy_utility.md, .json and .png into `workdir`; returns the Markdown table."""
  table = tradeoff_table(points)
  rows = [{'algorithm': p.algorithm, 'target_epsilon': None if math.isinf(p.epsilon) else p.epsilon,
           'spent_epsilon': p.spent, 'final_accuracy': p.accuracies.tolist(),
           'noise_multiplier': [(s.get('dp') or {}).get('noise_multiplier') for s in p.result.summaries]}
          for p in points]
  write_outputs(workdir, {'privacy_utility.md': f'# {title}\n\n{table}',
                          'privacy_utility.json': strict_json(rows, indent=2)},
                lambda: plot_tradeoff(points, os.path.join(workdir, 'privacy_utility.png'), title))
  return table
