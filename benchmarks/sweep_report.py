"""The accelerator sweep's report: its parts merged into one results file, their tables, and a figure.

  python benchmarks/sweep_report.py OUT

Reads every part under OUT as benchmarks/gpu_sweep.sh leaves them (OUT/*.json and OUT/*/*.json: vs_pytorch_<backend>,
host_cpu_tN/vs_pytorch_cpu, scaling_gN_<method>/scaling_<backend>, gpu_plan_<backend>, paper_settings/paper_settings_
<backend>, paper_settings/paper_settings_archs_<backend>, xla_flags/xla_flags_<backend> and vmap_conv/vmap_conv_
<backend>; also parts copied there from separate commands or machines) and writes OUT/gpu_sweep_<backend>.json
(every part; <backend> is the accelerator's where any part ran on one), OUT/gpu_sweep_<backend>.md (per part: its
command, the machine, its settings and its table in the columns of docs/performance.md) and, where a part measured
rounds, OUT/gpu_sweep_<backend>.png: seconds per round against clients for fedjax_het and the PyTorch loop, the same
on the host CPU against fedjax_het's client threads (the host_cpu_tN parts), seconds per round against clients for
each algorithm and number of architecture groups, and peak memory. A part stopped at its time limit is reported with
the rows it finished.
"""

from __future__ import annotations

import glob
import json
import os
import sys

# (header, row key, format) per column; a missing value prints as '-'.
VS_PYTORCH = [('clients', 'num_clients', '{}'), ('SGD steps / round', 'local_steps', '{}'),
              ('PyTorch s/round', 'torch_seconds_per_round', '{:.3f}'),
              ('fedjax_het s/round', 'fedjax_seconds_per_round', '{:.3f}'), ('speed-up', 'speedup_vs_torch', '{:.2f}x'),
              ('first round s', 'fedjax_first_round_seconds', '{:.1f}'),
              ('compilations first / later', ('fedjax_compilations_first_round', 'fedjax_compilations_later'),
               '{} / {}'),
              ('client-steps/s fedjax_het / PyTorch',
               ('fedjax_client_steps_per_second', 'torch_client_steps_per_second'), '{:.0f} / {:.0f}')]
SCALING = [('method', 'algorithm', '{}'), ('clients', 'num_clients', '{}'), ('groups', 'groups', '{}'),
           ('first round (s)', 'first_round_seconds', '{:.2f}'), ('compile (s)', 'compile_seconds', '{:.2f}'),
           ('compilations first / later', ('compilations_first_round', 'compilations_later_rounds'), '{} / {}'),
           ('s / round', 'seconds_per_round', '{:.3f}'), ('client-steps / s', 'client_steps_per_second', '{:.1f}'),
           ('peak memory (MiB)', 'peak_memory_mib', '{:.0f}')]
PLAN = [('setting', 'setting', '{}'), ('group', 'group', '{}'), ('clients', 'clients', '{}'),
        ('steps / client', 'steps_per_client', '{}'), ('GFLOP / round', 'gflop_per_round', '{:.2f}'),
        ('GB moved / round', 'gb_moved_per_round', '{:.2f}'), ('roofline (s)', 'roofline_seconds', '{:.4f}'),
        ('loop bound (s)', 'loop_bound_seconds', '{:.4f}'), ('vmap bound (s)', 'vmap_bound_seconds', '{:.4f}'),
        ('fit', 'clients_fit', '{:,}')]

PAPER = [('setting', 'setting', '{}'), ('clients', 'num_clients', '{}'), ('architectures', 'architectures', '{}'),
         ('SGD steps / round', 'local_steps', '{}'),
         ('to first round, cold / warm (s)', ('cold_to_first_round_seconds', 'warm_to_first_round_seconds'),
          '{:.1f} / {:.1f}'), ('PyTorch to first round (s)', 'torch_to_first_round_seconds', '{:.1f}'),
         ('fedjax_het s/round', 'fedjax_round_seconds', '{:.3f}'), ('PyTorch s/round', 'torch_round_seconds', '{:.3f}'),
         ('speed-up', 'speedup_vs_torch', '{:.2f}x'),
         ('peak device MiB fedjax_het / PyTorch', ('fedjax_peak_device_mib', 'torch_peak_device_mib'), '{:.0f} / {:.0f}'),
         ('peak RSS MiB fedjax_het / PyTorch', ('fedjax_peak_rss_mib', 'torch_peak_rss_mib'), '{:.0f} / {:.0f}')]
PAPER_ARCHS = [('setting', 'setting', '{}'), ('architecture', 'arch', '{}'), ('clients', 'clients', '{}'),
               ('first round cold / warm (s)', ('fedjax_first_round_cold_seconds', 'fedjax_first_round_warm_seconds'),
                '{:.2f} / {:.2f}'), ('PyTorch first round (s)', 'torch_first_round_seconds', '{:.2f}'),
               ('fedjax_het s/round', 'fedjax_round_seconds', '{:.3f}'), ('PyTorch s/round', 'torch_round_seconds',
                                                                         '{:.3f}')]

XLA_FLAGS = [('architecture', 'arch', '{}'), ('XLA_FLAGS', 'xla_flags', '{}'),
             ('to first round (s)', 'to_first_round_seconds', '{:.1f}'), ('compile (s)', 'compile_seconds', '{:.1f}'),
             ('compilations', 'compilations', '{}'), ('s / round', 'round_seconds', '{:.3f}'),
             ('stopped at (s)', 'stopped_at_seconds', '{:.0f}'), ('failed', 'failed', '{}')]

VMAP_CONV = [('what', 'what', '{}'), ('formulation', 'formulation', '{}'), ('clients', 'clients', '{}'),
             ('step (s)', 'seconds', '{:.4f}'), ('client-steps / s', 'client_steps_per_second', '{:,.0f}'),
             ('forward (ms)', 'forward_ms', '{:.2f}'), ('forward + backward (ms)', 'forward_backward_ms', '{:.2f}'),
             ('compile (s)', 'compile_seconds', '{:.1f}'),
             ('forward + backward compile (s)', 'forward_backward_compile_seconds', '{:.1f}'),
             ('failed', 'failed', '{}')]

# A results file's keys that are not the run's settings (harness.machine(), the command, the rows).
NOT_SETTINGS = {'backend', 'device', 'device_kind', 'cpu_count', 'machine', 'cpu_model', 'cpu_vector', 'jax',
                'versions', 'command', 'complete', 'rows'}


def read_parts(out: str) -> dict[str, dict]:
  """{part name: its results} for every results file under `out` and one folder down, the report's own excepted;
  the name is the file's path below `out` without '.json' (e.g. 'scaling_g5_fedre/scaling_gpu')."""
  parts = {}
  for path in sorted(glob.glob(os.path.join(out, '*.json')) + glob.glob(os.path.join(out, '*', '*.json'))):
    name = os.path.relpath(path, out)[:-len('.json')].replace(os.sep, '/')
    if not os.path.basename(name).startswith('gpu_sweep'):
      with open(path) as f:
        parts[name] = json.load(f)
  return parts


def sweep_backend(parts: dict[str, dict]) -> str:
  """The sweep's accelerator backend ('gpu', 'tpu'), 'cpu' where every part ran on a CPU (the host_cpu parts do
  on any machine), 'none' without parts."""
  backends = sorted({part.get('backend', 'cpu') for part in parts.values()})
  return next((b for b in backends if b != 'cpu'), backends[0] if backends else 'none')


def kind(part: dict) -> str | None:
  """'vs_pytorch', 'scaling', 'plan', 'paper', 'paper_archs', 'xla_flags' or 'vmap_conv' by what its rows hold;
  None for anything else."""
  keys = set().union(*(row.keys() for row in part.get('rows', [])))
  if 'cold_to_first_round_seconds' in keys:
    return 'paper'
  if 'xla_flags' in keys:
    return 'xla_flags'
  if 'arch' in keys and 'torch_round_seconds' in keys:
    return 'paper_archs'
  if 'torch_seconds_per_round' in keys:
    return 'vs_pytorch'
  if 'groups' in keys and ('seconds_per_round' in keys or 'out_of_memory' in keys):
    return 'scaling'
  if 'roofline_seconds' in keys:
    return 'plan'
  if 'formulation' in keys:
    return 'vmap_conv'
  return None


def cell(row: dict, key, fmt: str) -> str:
  """One table cell: row[key] (or the tuple of keys) in `fmt`; '-' where a value is missing."""
  values = [row.get(k) for k in (key if isinstance(key, tuple) else (key,))]
  return '-' if any(v is None for v in values) else fmt.format(*values)


def table(rows: list[dict], columns: list[tuple]) -> str:
  """A Markdown table of `rows` in `columns`; a row that ran out of memory says so after its first cells."""
  lines = ['| ' + ' | '.join(c[0] for c in columns) + ' |', '|' + '---|' * len(columns)]
  for row in rows:
    cells = [cell(row, key, fmt) for _, key, fmt in columns]
    if row.get('out_of_memory'):
      cells = cells[:3] + ['out of memory'] + [''] * (len(columns) - 4)
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def describe(name: str, part: dict) -> str:
  """A part's heading, status, command and machine, as Markdown."""
  status = ('' if part.get('complete', True) else
            f' (stopped at its time limit after {len(part.get("rows", []))} rows)')
  where = [f'{part.get("device_kind", part.get("device", "?"))} ({part.get("backend", "?")})']
  if 'cpu_count' in part:
    model = ', '.join(part[k] for k in ('cpu_model', 'cpu_vector') if part.get(k))
    where.append(f'{part["cpu_count"]} CPU cores' + (f' ({model})' if model else ''))
  versions = part.get('versions') or ({'jax': part['jax']} if 'jax' in part else {})
  where.append(', '.join(f'{k} {v}' for k, v in versions.items()))
  settings = ', '.join(f'{k} {v}' for k, v in part.items() if k not in NOT_SETTINGS and v is not None
                       and not isinstance(v, (dict, list)))
  return '\n'.join([f'## {name}{status}', '', f'`{part.get("command", "(command not recorded)")}`', '',
                    '; '.join(w for w in where if w) + '.'] + (['', f'Settings: {settings}.'] if settings else []))


def markdown(parts: dict[str, dict]) -> str:
  """The report: one section per part, with its table."""
  columns = {'vs_pytorch': VS_PYTORCH, 'scaling': SCALING, 'plan': PLAN, 'paper': PAPER, 'paper_archs': PAPER_ARCHS,
             'xla_flags': XLA_FLAGS, 'vmap_conv': VMAP_CONV}
  sections = []
  for name, part in parts.items():
    k = kind(part)
    body = table(part['rows'], columns[k]) if k else 'No rows this report knows how to tabulate.'
    sections.append(describe(name, part) + '\n\n' + body)
  return f'# Accelerator sweep ({sweep_backend(parts)})\n\n' + '\n\n'.join(sections) + '\n'


def figure(parts: dict[str, dict], path: str) -> bool:
  """Seconds per round and peak memory against clients (log-log), as a PNG at `path`; False where no part
  measured rounds."""
  host = {n: p for n, p in parts.items() if kind(p) == 'vs_pytorch' and n.startswith('host_cpu_t')}
  vs = {n: p for n, p in parts.items() if kind(p) == 'vs_pytorch' and n not in host}
  scaling = {n: p for n, p in parts.items() if kind(p) == 'scaling'}
  if not vs and not scaling and not host:
    return False
  try:
    import matplotlib
  except ImportError:
    print('sweep_report.py: no figure, matplotlib is not installed (pip install matplotlib)')
    return False
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import matplotlib.ticker
  panels = (['vs'] if vs else []) + (['host'] if host else []) + (['scaling', 'memory'] if scaling else [])
  fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  axes = dict(zip(panels, axes[0]))
  for name, part in vs.items():
    rows = part['rows']
    clients = [r['num_clients'] for r in rows]
    axes['vs'].plot(clients, [r['fedjax_seconds_per_round'] for r in rows], 'o-', label=f'fedjax_het ({name})')
    axes['vs'].plot(clients, [r['torch_seconds_per_round'] for r in rows], 's--',
                    label=f'PyTorch loop, {part.get("torch_device", "?")} ({name})')
  by_clients = {}  # host CPU: per client count, (client threads, fedjax_het s, PyTorch s) over the parts
  for name, part in host.items():
    threads = part.get('client_threads') or int(name.split('/')[0][len('host_cpu_t'):])
    for r in part['rows']:
      by_clients.setdefault(r['num_clients'], []).append(
          (threads, r['fedjax_seconds_per_round'], r['torch_seconds_per_round']))
  for k, points in sorted(by_clients.items()):
    points = sorted(points)
    threads = [p[0] for p in points]
    line, = axes['host'].plot(threads, [p[1] for p in points], 'o-', label=f'fedjax_het, {k} clients')
    axes['host'].plot(threads, [p[2] for p in points], 's--', color=line.get_color(),
                      label=f'PyTorch loop ({next(iter(host.values())).get("torch_threads", "?")} threads), '
                            f'{k} clients')
  for name, part in scaling.items():
    series = {}
    for r in part['rows']:
      if not r.get('out_of_memory'):
        series.setdefault((r['algorithm'], r['groups'], r.get('model', '')), []).append(r)
    for (algorithm, groups, model), rows in sorted(series.items()):
      label = f'{algorithm}, {groups} group{"s" if groups > 1 else ""}' + (f', {model}' if model else '')
      clients = [r['num_clients'] for r in rows]
      axes['scaling'].plot(clients, [r['seconds_per_round'] for r in rows], 'o-', label=label)
      axes['memory'].plot(clients, [r['peak_memory_mib'] for r in rows], 'o-', label=label)
  memory_kinds = {r.get('memory_kind') for p in scaling.values() for r in p['rows']} - {None}
  memory = {'device_peak': 'device peak', 'host_peak_rss': 'process peak RSS'}
  titles = {'vs': ('seconds per round', 'FedRE round: fedjax_het and the PyTorch loop'),
            'host': ('seconds per round', 'The same on the host CPU'),
            'scaling': ('seconds per round', 'Round cost over clients and groups'),
            'memory': (f'MiB ({", ".join(sorted(memory.get(k, k) for k in memory_kinds))})', 'Peak memory')}
  plain = matplotlib.ticker.FormatStrFormatter('%g')
  for panel, ax in axes.items():
    if not ax.get_lines():  # every row of its parts out of memory
      ax.set_title(titles[panel][1] + ': no rows', fontsize=10)
      continue
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xticks(sorted({x for line in ax.get_lines() for x in line.get_xdata()}))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis='y', which='minor', labelsize=7)
    ax.set_xlabel("fedjax_het's client threads" if panel == 'host' else 'clients')
    ax.set_ylabel(titles[panel][0])
    ax.set_title(titles[panel][1], fontsize=10)
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
  first = next(iter({**vs, **scaling, **host}.values()))
  fig.suptitle(f'{first.get("device_kind", first.get("device", "?"))}, jax {first.get("jax", "?")}', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return True


def main(out: str) -> None:
  parts = read_parts(out)
  base = os.path.join(out, f'gpu_sweep_{sweep_backend(parts)}')
  with open(base + '.json', 'w') as f:
    json.dump({'tiny': os.environ.get('TINY', '0') == '1', 'parts': parts}, f, indent=2)
  with open(base + '.md', 'w') as f:
    f.write(markdown(parts))
  drawn = figure(parts, base + '.png')
  print('wrote', base + '.json', base + '.md', *([base + '.png'] if drawn else []),
        '(' + ', '.join(f'{n}' + ('' if p.get('complete', True) else ' [stopped]') for n, p in parts.items()) + ')')


if __name__ == '__main__':
  if len(sys.argv) != 2:
    sys.exit('usage: python benchmarks/sweep_report.py OUT (the folder gpu_sweep.sh wrote its parts to)')
  main(sys.argv[1])
