"""Pictures of a run: the accuracy curve and the partition."""

from __future__ import annotations

import numpy as np


def save_line_plot(fig, ax, path: str, xlabel: str, ylabel: str, title: str, legend_size=8, title_size=None) -> None:
  """Labels, grid and legend of a line plot, then the figure saved as a PNG at `path` and closed."""
  import matplotlib.pyplot as plt
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=title_size)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=legend_size)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_accuracy(rows: list[dict], path: str, title: str, architectures=None) -> None:
  """Accuracy (and the local-head accuracy where logged) against round, as a PNG; where the run has several
  phases, a dotted line marks where each begins, with its name; with `architectures` (one name per client) of
  several kinds, one thin line per architecture: the mean accuracy of its clients (GeFL's per-architecture
  curves)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for before, row in zip(rows, rows[1:]):
    if row.get('phase') != before.get('phase'):
      ax.axvline(before['round'] + 0.5, color='grey', linestyle=':', linewidth=1)
      ax.annotate(row['phase'], (before['round'] + 0.5, 0.02), xycoords=('data', 'axes fraction'), fontsize=8,
                  rotation=90, color='grey', ha='right')
  rows = [r for r in rows if 'accuracy' in r]
  ax.plot([r['round'] for r in rows], [100 * r['accuracy'] for r in rows], label=rows[0]['eval_head'] if rows else '', marker='.' if len(rows) < 30 else None)
  if rows and 'local_head_accuracy' in rows[0]:
    ax.plot([r['round'] for r in rows], [100 * r['local_head_accuracy'] for r in rows], '--', label='local_head')
  per_client = [r for r in rows if r.get('client_accuracy')]
  if architectures is not None and len(set(architectures)) > 1 and per_client:
    archs = np.asarray(architectures)
    for arch in dict.fromkeys(architectures):
      ax.plot([r['round'] for r in per_client],
              [100 * float(np.mean(np.asarray(r['client_accuracy'])[archs == arch])) for r in per_client],
              linewidth=0.8, alpha=0.6, label=arch)
  save_line_plot(fig, ax, path, 'round', 'test accuracy (%)', title,
                 legend_size=6 if architectures is not None and len(set(architectures)) > 4 else None)


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


def sample_canvas(generated: np.ndarray, real: np.ndarray) -> np.ndarray:
  """The picture of `plot_samples` as one image in [0, 1]: one row per class, `real` images [C, m, H, W, ch] on the
  left, a white gap of max(2, W // 2) columns, then the `generated` ones [C, n, H, W, ch] (both in [-1, 1]), each
  image followed by one white row and column."""
  to_unit = lambda a: np.clip((np.asarray(a, np.float32) + 1.0) / 2.0, 0.0, 1.0)
  classes, m, n = generated.shape[0], real.shape[1], generated.shape[1]
  h, w, ch = generated.shape[2:]
  gap = max(2, w // 2)
  canvas = np.ones((classes * (h + 1), m * (w + 1) + gap + n * (w + 1), ch), np.float32)
  for c in range(classes):
    for j in range(m):
      canvas[c * (h + 1):c * (h + 1) + h, j * (w + 1):j * (w + 1) + w] = to_unit(real[c, j])
    for j in range(n):
      left = m * (w + 1) + gap + j * (w + 1)
      canvas[c * (h + 1):c * (h + 1) + h, left:left + w] = to_unit(generated[c, j])
  return canvas


def plot_samples(generated: np.ndarray, real: np.ndarray, path: str, title: str) -> None:
  """`sample_canvas` with a title, as a PNG (FedVTC Figure 4; GeFL's sample grids)."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  canvas = sample_canvas(generated, real)
  ch = canvas.shape[-1]
  fig, ax = plt.subplots(figsize=(max(4, canvas.shape[1] / 12), max(3, canvas.shape[0] / 12)))
  ax.imshow(canvas[..., 0] if ch == 1 else canvas, cmap='gray' if ch == 1 else None, vmin=0, vmax=1,
            interpolation='nearest')
  ax.set_title(f'{title}\nleft: real, right: generated; one row per class', fontsize=9)
  ax.axis('off')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
