"""Per-round metrics of finished runs, averaged over seeds: a picture and a markdown table.

  python experiments/plot_metrics.py --runs=/tmp/felo_mnist5k/felo,/tmp/felo_mnist5k/fedhe \
      --metrics=client_ce,client_alpha_mse,client_alpha_kl --out=/tmp/felo_terms

--runs: method folders of experiments/compare.py (each holding seed*/metrics.jsonl) or single run workdirs. Each
metric of each run is drawn against the round (mean over its seeds, shaded min to max); the table gives, per run
and metric, the mean over seeds of the metric's mean over the rounds of each half of the run. Writes OUT.png and
OUT.md.
"""

import glob
import json
import os

from fedjax_het.run import cli  # noqa: E402
from absl import flags

flags.DEFINE_list('runs', None, 'Method folders (seed*/metrics.jsonl inside) or run workdirs.')
flags.DEFINE_list('metrics', None, 'metrics.jsonl keys to draw.')
flags.DEFINE_string('out', None, 'Output path without extension (.png and .md are written).')
flags.mark_flags_as_required(['runs', 'metrics', 'out'])
FLAGS = flags.FLAGS


def seed_histories(folder: str) -> list[list[dict]]:
  """The metrics.jsonl rows of each seed run under `folder` (or of `folder` itself)."""
  files = sorted(glob.glob(os.path.join(folder, 'seed*', 'metrics.jsonl'))) or \
      [f for f in [os.path.join(folder, 'metrics.jsonl')] if os.path.exists(f)]
  out = []
  for path in files:
    with open(path) as f:
      out.append([json.loads(line) for line in f if line.strip()])
  return out


def main(argv):
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np
  runs = {os.path.basename(os.path.normpath(r)): seed_histories(r) for r in FLAGS.runs}
  missing = [name for name, h in runs.items() if not h]
  if missing:
    from fedjax_het.errors import ConfigError
    raise ConfigError(f'--runs: no metrics.jsonl under {", ".join(missing)}. Fix: the workdirs of finished or '
                      f'started runs (or their seed_N folders\' parent, as experiments/compare.py writes them).')
  fig, axes = plt.subplots(1, len(FLAGS.metrics), figsize=(4.2 * len(FLAGS.metrics), 3.4), squeeze=False)
  lines = ['| run | metric | seeds | first half of the rounds | second half |', '|---|---|---|---|---|']
  for ax, metric in zip(axes[0], FLAGS.metrics):
    for name, histories in runs.items():
      per_seed = [[(row['round'], row[metric]) for row in h if metric in row] for h in histories]
      per_seed = [s for s in per_seed if s]
      if not per_seed:
        continue
      rounds = np.array([r for r, _ in per_seed[0]])
      values = np.array([[v for _, v in s][:len(rounds)] for s in per_seed])
      ax.plot(rounds, values.mean(0), label=name)
      ax.fill_between(rounds, values.min(0), values.max(0), alpha=0.2)
      half = len(rounds) // 2
      first, second = values[:, :half].mean(1), values[:, half:].mean(1)
      lines.append(f'| {name} | {metric} | {len(per_seed)} | {first.mean():.4f} +- {first.std():.4f} | '
                   f'{second.mean():.4f} +- {second.std():.4f} |')
    ax.set_title(metric, fontsize=9)
    ax.set_xlabel('round')
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(FLAGS.out + '.png', dpi=110)
  with open(FLAGS.out + '.md', 'w') as f:
    f.write('\n'.join(lines) + '\n')
  print('\n'.join(lines))


if __name__ == '__main__':
  cli.app_run(main)
