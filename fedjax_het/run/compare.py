"""Several methods on one setting, same seeds and partitions: a Markdown table and one accuracy-vs-round plot.

Each (method, seed) run is an ordinary experiment in `<workdir>/<method>/seed<seed>/`; a finished run with the
same config is reused and an interrupted one resumes from its checkpoint, so a comparison can be stopped and
continued.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Sequence

import numpy as np
from absl import logging

from fedjax_het.errors import ConfigError
from fedjax_het.run.config import ExperimentConfig, resumable_settings, run_settings
from fedjax_het.run.experiment import TrainingDiverged, train_and_evaluate
from fedjax_het.run.plots import save_line_plot
from fedjax_het.run.registry import METHODS, config_with, flag_name
from fedjax_het.run.workdir import Workdir, strict_json


@dataclasses.dataclass
class MethodResult:
  """One method's runs over the seeds: summaries and per-round accuracy curves (rounds, accuracies per seed)."""
  algorithm: str
  summaries: list[dict]
  curves: list[tuple[list[int], list[float]]]


def _finished_summary(workdir: str, cfg: ExperimentConfig):
  path = os.path.join(workdir, 'summary.json')
  if not os.path.exists(path):
    return None
  with open(path) as f:
    summary = json.load(f)
  if not (summary.get('finished') or summary.get('diverged_round')) or 'config' not in summary:
    return None  # a run that diverged ended for good: its outcome is kept, not run again
  return summary if _settings(summary['config']) == _settings(cfg.to_dict()) else None


def _settings(config: dict) -> dict:
  """The settings a run's numbers depend on: `run_settings` without how it was executed (strategy, threads,
  checkpoints, ...), which changes nothing but rounding."""
  return {k: v for k, v in run_settings(config).items() if k == 'rounds' or k not in resumable_settings()}


def _refuse_other_run(run_dir: str, cfg: ExperimentConfig) -> None:
  """A ConfigError where `run_dir`, which holds a run and no checkpoint to resume, holds one of other settings
  (or of unknown ones): a comparison runs again only its own runs stopped before their first checkpoint, and never
  deletes another's results."""
  path = os.path.join(run_dir, 'config.json')
  try:
    with open(path) as f:
      saved = _settings(json.load(f))
  except (OSError, ValueError):
    saved = None
  now = _settings(cfg.to_dict())
  if saved == now:
    return
  changed = [] if saved is None else [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
  differences = ', '.join(f'{k}: {saved.get(k)!r} there, {now.get(k)!r} now' for k in changed[:6])
  what = (f'a run with other settings ({differences})' if saved is not None
          else 'a run whose config.json cannot be read')
  raise ConfigError(f'--workdir: {run_dir} holds {what}, and no checkpoint to continue from, so running this '
                    f'setting there would replace it. Fix: a new --workdir for this comparison, or move that folder '
                    f'away (nothing is deleted).')


def _curve(workdir: str) -> tuple[list[int], list[float]]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if 'accuracy' in r]
  return [r['round'] for r in rows], [r['accuracy'] for r in rows]


def parse_entry(entry: str) -> tuple[str, dict]:
  """A --algorithms entry: a method name, or a variant NAME[flag=value;flag=value] of its hyperparameters, e.g.
  'gefl[gefl_generator=ddpm;gefl_guidance=2]' -> ('gefl', {'gefl_generator': 'ddpm', 'gefl_guidance': 2.0})."""
  name, _, rest = entry.partition('[')
  if not rest:
    return entry, {}
  if not rest.endswith(']'):
    raise ConfigError(f'--algorithms entry {entry!r}: write a variant as NAME[flag=value;flag=value].')
  fields = {flag_name(f): f for f in dataclasses.fields(METHODS[name].config)} if name in METHODS else {}
  values = {}
  for item in filter(None, rest[:-1].split(';')):
    flag, eq, value = item.partition('=')
    if not eq or flag not in fields:
      raise ConfigError(f'--algorithms entry {entry!r}: {item!r} is not flag=value of a hyperparameter of {name} '
                        f'({", ".join(fields) or "none"}).')
    kind = type(fields[flag].default)
    try:
      values[flag] = value.lower() in ('1', 'true') if kind is bool else kind(value)
    except ValueError:
      raise ConfigError(f'--algorithms entry {entry!r}: {flag}={value!r} is not a {kind.__name__}.') from None
  return name, values


def run_comparison(base: ExperimentConfig, algorithms: Sequence[str], seeds: Sequence[int], workdir: str,
                   progress: bool = True, tensorboard: bool = False) -> list[MethodResult]:
  """Runs (or reuses, or resumes) every (algorithm or variant, seed) of `base` and collects the results."""
  unknown = [a for a in algorithms if parse_entry(a)[0] not in METHODS]
  if unknown or not algorithms:
    raise ConfigError(f'--algorithms: unknown or empty {unknown or list(algorithms)}; choose from '
                      f'{", ".join(METHODS)}.')
  if not seeds:
    raise ConfigError('--seeds is empty; give at least one seed, e.g. --seeds=0,1,2.')
  results, total = [], len(algorithms) * len(seeds)
  say = (lambda text: sys.stderr.write(f'compare: {text}\n')) if progress else (lambda text: None)
  for algorithm in algorithms:
    summaries, curves = [], []
    name, values = parse_entry(algorithm)
    methods = {**base.methods, name: config_with(name, values, base.methods[name])}
    for seed in seeds:
      cfg = dataclasses.replace(base, algorithm=name, seed=int(seed), methods=methods)
      run_dir = os.path.join(workdir, algorithm.replace('[', '_').replace(']', '').replace(';', '_'), f'seed{seed}')
      summary = _finished_summary(run_dir, cfg)
      done = len(results) * len(seeds) + len(summaries) + 1
      if summary is not None:
        say(f'{done}/{total} {algorithm}, seed {seed}: reused the finished run in {run_dir}')
      if summary is None:
        resume = Workdir(run_dir).has_checkpoints()
        say(f'{done}/{total} {algorithm}, seed {seed}: {"resuming" if resume else "running"} in {run_dir}')
        if not resume and Workdir(run_dir).holds_run():
          _refuse_other_run(run_dir, cfg)
          shutil.rmtree(run_dir)  # this comparison's own run, stopped before its first checkpoint: start it again
        try:
          summary = train_and_evaluate(cfg, run_dir, resume=resume, progress=progress, tensorboard=tensorboard)
        except TrainingDiverged as e:  # an outcome of the method at this setting: recorded, the others go on
          logging.warning('%s, seed %d: %s', algorithm, seed, e)
          summary = _finished_summary(run_dir, cfg)
      summaries.append(summary)
      curves.append(_curve(run_dir))
    results.append(MethodResult(algorithm, summaries, curves))
  return results


def _mean_std(values: Sequence[float], scale: float = 100.0) -> str:
  v = scale * np.asarray(values, float)
  return f'{v.mean():.2f} +- {v.std():.2f}'


def diverged_note(summaries: Sequence[dict]) -> str:
  """' (k diverged)' when k of the runs ended with a NaN/inf loss (their final accuracy is their last model's)."""
  k = sum(1 for s in summaries if s.get('diverged_round'))
  return f' ({k} diverged)' if k else ''


def comparison_table(results: Sequence[MethodResult]) -> str:
  """Markdown: per method, mean +- std over seeds (population std) of the final and best-round accuracy (%; a run
  that diverged counts with its last model, and the seeds column says how many did),
  and upload / broadcast scalars per round (mean over rounds and seeds); then, where the summaries hold them, GeFL's
  mean over architectures of their best rounds, Felo's mean over the second half of the rounds, and for methods of
  several phases the accuracy at the end of each phase (FedVTC: before and after fine-tuning)."""
  lines = ['| method | final accuracy (%) | best-round accuracy (%) | upload / broadcast scalars per round | seeds |',
           '|---|---|---|---|---|']
  for r in results:
    up = np.mean([s['upload_scalars_per_round'] for s in r.summaries])
    down = np.mean([s['broadcast_scalars_per_round'] for s in r.summaries])
    lines.append(f'| {r.algorithm} | {_mean_std([s["final_accuracy"] for s in r.summaries])} | '
                 f'{_mean_std([s["best_accuracy"] for s in r.summaries])} | {up:,.0f} / {down:,.0f} | '
                 f'{len(r.summaries)}{diverged_note(r.summaries)} |')
  if any(s.get('best_accuracy_per_architecture_mean') is not None for r in results for s in r.summaries):
    lines += ['', '| method | mean over architectures of each one\'s best-round accuracy (%) |', '|---|---|']
    lines += [f'| {r.algorithm} | {_mean_std([s["best_accuracy_per_architecture_mean"] for s in r.summaries])} |'
              for r in results]
  if all(s.get('second_half_mean_accuracy') is not None for r in results for s in r.summaries):
    lines += ['', '| method | mean accuracy over the second half of the rounds (%) |', '|---|---|']
    lines += [f'| {r.algorithm} | {_mean_std([s["second_half_mean_accuracy"] for s in r.summaries])} |'
              for r in results]
  phased = [r for r in results if len(r.summaries[0].get('final_accuracy_by_phase') or {}) > 1]
  if phased:
    lines += ['', '| method | accuracy at the end of each phase (%) |', '|---|---|']
    for r in phased:
      phases = r.summaries[0]['final_accuracy_by_phase']
      lines.append(f'| {r.algorithm} | ' + '; '.join(
          f'{phase} {_mean_std([s["final_accuracy_by_phase"][phase] for s in r.summaries])}' for phase in phases)
          + ' |')
  return '\n'.join(lines) + '\n'


def plot_comparison(results: Sequence[MethodResult], path: str, title: str) -> None:
  """Accuracy against round, mean over seeds (shaded: min to max), one line per method."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  colors = plt.get_cmap('tab20').colors  # 20 distinct colours; line styles tell apart any beyond
  styles = ('-', '--', ':', '-.')
  for i, r in enumerate(results):
    rounds = r.curves[0][0]
    acc = 100 * np.asarray([c[1] for c in r.curves if c[0] == rounds])
    color = colors[(2 * i) % 20 + (2 * i) // 20 % 2]
    ax.plot(rounds, acc.mean(0), label=r.algorithm, color=color, linestyle=styles[i // 10 % len(styles)])
    ax.fill_between(rounds, acc.min(0), acc.max(0), alpha=0.15, color=color)
  save_line_plot(fig, ax, path, 'round', 'test accuracy (%)', title)


def write_comparison(results: Sequence[MethodResult], workdir: str, title: str) -> str:
  """Writes comparison.md, comparison.json and comparison.png into `workdir`; returns the Markdown table."""
  table = comparison_table(results)
  rows = [{'algorithm': r.algorithm, 'summaries': [{k: v for k, v in s.items() if k != 'config'}
                                                   for s in r.summaries]} for r in results]
  write_outputs(workdir, {'comparison.md': f'# {title}\n\n{table}', 'comparison.json': strict_json(rows, indent=2)},
                lambda: plot_comparison(results, os.path.join(workdir, 'comparison.png'), title))
  return table


def write_outputs(workdir: str, texts: dict, plot) -> None:
  """Writes each of `texts` (file name -> text) into `workdir`, then `plot()`; where the folder cannot be
  written (a read-only file system), one warning says so and the caller's table is still printed."""
  try:
    for name, text in texts.items():
      with open(os.path.join(workdir, name), 'w') as f:
        f.write(text)
    plot()
  except OSError as e:
    logging.warning('could not write %s into %s (%s); the table is printed only.', ', '.join(texts), workdir,
                    e.strerror or e)
