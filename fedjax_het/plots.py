"""Pictures of a run: the accuracy curve and the partition."""

from __future__ import annotations

import numpy as np


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
