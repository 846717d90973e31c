"""Tables and figures of an inversion attack's leakage."""

from __future__ import annotations

from typing import Sequence

import numpy as np

# ---------------------------------------------------------------------------------------------------- reports
def mean_std(values: Sequence[float], digits: int = 2) -> str:
  """'mean +- std' (population std) of finite values; '-' when there are none."""
  v = np.asarray(values, float)
  v = v[np.isfinite(v)]
  return '-' if not len(v) else f'{v.mean():.{digits}f} +- {v.std():.{digits}f}'


def leakage_table(results: Sequence[dict]) -> str:
  """Markdown: per method (in order), its upload kind and targets, then each measure as mean +- std over the
  seeds' means: PSNR (dB), MSE (0-255) and SSIM against the reference, the PSNR's gain over the null image's, the
  best-match PSNR and its gain over the null image's best match, the identification rate against its chance
  level, the attack's final representation loss and the accuracy after the attacked round. `results`: dicts with
  'method', 'seed', 'kind', arrays over that run's targets 'psnr', 'mse', 'null_psnr', 'best_psnr',
  'best_null_psnr', 'identified', 'rep_loss', 'ssim' and 'null_ssim' (optional), and 'accuracy' (None when not
  evaluated)."""
  lines = ['| method | upload | targets | PSNR vs reference (dB) | gain over null (dB) | MSE vs reference | '
           'SSIM vs reference (null) | best-match PSNR (dB) | gain over null (dB) | identified (%) | chance (%) | '
           'attack loss | accuracy (%) | seeds |', '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|']
  for name in dict.fromkeys(r['method'] for r in results):
    runs = [r for r in results if r['method'] == name]
    per_seed = lambda f, digits=2: mean_std([f(r) for r in runs], digits)
    mean = lambda k: (lambda r: float(np.mean(np.asarray(r[k], float))))
    gain = lambda a, b: (lambda r: float(np.mean(np.asarray(r[a], float) - np.asarray(r[b], float))))
    acc = [100 * r['accuracy'] for r in runs if r.get('accuracy') is not None]
    ssim = (f'{per_seed(mean("ssim"), 3)} ({per_seed(mean("null_ssim"), 3)})' if all('ssim' in r for r in runs)
            else '-')  # inversion.json files written before SSIM was measured
    lines.append(f'| {name} | {"/".join(dict.fromkeys(r["kind"] for r in runs))} | '
                 f'{sum(len(r["psnr"]) for r in runs)} | {per_seed(mean("psnr"))} | '
                 f'{per_seed(gain("psnr", "null_psnr"))} | {per_seed(mean("mse"), 1)} | {ssim} | '
                 f'{per_seed(mean("best_psnr"))} | '
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
