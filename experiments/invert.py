"""Representation inversion attacks on what each method uploads (FedRE Q2: "FedRE: A Representation Entanglement
Framework for Model-Heterogeneous Federated Learning", Sec. 4 and Appendix C.1).

For every --methods entry and --seeds seed it trains the method for --rounds - 1 rounds, runs the last round's
client programs on --attack_clients to get their uploads (fedjax_het/evaluation/upload_attack.py,
`round_uploads`), inverts up to
--targets_per_client vectors of each upload through that client's trained extractor (white box; the deep image
prior by default), and measures PSNR / MSE (0-255 scale) against the image each upload describes (its sample, its
class's mean image, its soft label's mix of class means), the best-match score, each one's gain over an all-black
null image, and how often a reconstruction identifies its own reference among the run's. It then finishes the
round and evaluates the accuracy. Into --workdir it writes inversion.md (the table), inversion.json (every
target's numbers) and inversion.png (the first seed's references above their reconstructions, Figure 4).

  python experiments/invert.py --flagfile=experiments/flags/quickstart_mnist5k.flags --rounds=5 \
      --methods=fedallrep,fedgh,fedre --seeds=0,1,2 --workdir=/tmp/invert_mnist5k

--methods: method names (FedGH, FedTGP, CCVR, FedVTC, FedProto, FPL: class vectors; FedRE: one entangled
representation), 'fedallrep' (FedRE uploading every representation, --all_representations) and variants
NAME[flag=value;...] as in experiments/compare.py. --from_workdir=DIR instead attacks a run's latest checkpoint:
the uploads of the round after it. Every other flag is the experiment's (experiments/run.py).
"""

import dataclasses
import json
import os
import time

from absl import app, flags, logging

from fedjax_het.run import cli

cli.define_flags(default_algorithm='fedre')
flags.DEFINE_list('methods', None, 'Methods whose uploads are attacked (default: --algorithm); fedallrep = FedRE '
                  'with --all_representations; variants NAME[flag=value;...].')
flags.DEFINE_list('seeds', None, 'Seeds, one training run each (default: --seed).')
flags.DEFINE_string('from_workdir', None, 'Attack a run\'s latest checkpoint instead of training (its uploads in '
                    'the round after the checkpoint); --methods, --seeds and the experiment flags are then unused.')
flags.DEFINE_list('attack_clients', [str(k) for k in range(10)], 'Client ids whose uploads are attacked.')
flags.DEFINE_integer('targets_per_client', 2, 'Vectors inverted per attacked client (its first ones; FedRE '
                     'uploads one).')
flags.DEFINE_integer('min_class_samples', 10, 'Prototypes attacked: classes with at least this many samples on the '
                     'client, the most populated first.')
flags.DEFINE_integer('inversion_steps', 500, 'Adam steps of the attack.')
flags.DEFINE_float('inversion_lr', 0.01, 'Adam learning rate of the attack (0.05 suits --prior=pixel).')
flags.DEFINE_float('tv_weight', 0.1, 'Weight of the total-variation prior.')
flags.DEFINE_string('prior', 'dip', 'Image prior: dip (the deep image prior of FedRE\'s ref. [35]: a small conv '
                    'net\'s weights) or pixel (x = tanh(z)).')
flags.DEFINE_integer('dip_channels', 16, 'Width of the deep image prior net (--prior=dip).')
flags.DEFINE_integer('inversion_batch', 8, 'Targets per vmapped, jitted attack call.')
flags.DEFINE_integer('figure_columns', 8, 'Targets per method in inversion.png.')
flags.DEFINE_bool('evaluate', True, 'Finish the attacked round and report the accuracy after it.')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS

ALIASES = {'fedallrep': 'fedre[all_representations=true]'}
METRICS = ('psnr', 'mse', 'ssim', 'null_psnr', 'null_ssim', 'best_psnr', 'best_null_psnr', 'rep_loss')


def _ints(name: str, values):
  from fedjax_het.errors import ConfigError
  try:
    return [int(v) for v in values]
  except ValueError:
    raise ConfigError(f'--{name}={",".join(values)} must be integers, e.g. --{name}=0,1,2.') from None


def _runs(base):
  """(label, config) of every --methods entry and seed."""
  from fedjax_het.run.compare import parse_entry
  from fedjax_het.errors import ConfigError
  from fedjax_het.run.registry import METHODS, config_with
  entries = FLAGS.methods or [base.algorithm]
  seeds = _ints('seeds', FLAGS.seeds) if FLAGS.seeds else [base.seed]
  out = []
  for entry in entries:
    name, values = parse_entry(ALIASES.get(entry, entry))
    if name not in METHODS:
      raise ConfigError(f'--methods: {entry!r} is unknown; choose from fedallrep, {", ".join(METHODS)}.')
    methods = {**base.methods, name: config_with(name, values, base.methods[name])}
    for seed in seeds:
      out.append((entry, dataclasses.replace(base, algorithm=name, seed=seed, methods=methods)))
  return out


def _attack(label, cfg, fed, state, clients, inv_cfg, evaluate):
  """Attacks the uploads of the round after `state`; returns the run's result dict."""
  import jax
  import numpy as np
  from fedjax_het import evaluation as inversion
  start = time.perf_counter()
  attacked_round = int(state.round) + 1
  uploads = inversion.round_uploads(fed, state, clients)
  compiled, parts, attacked = {}, [], []
  for cu in uploads:
    part = inversion.attack_client(fed, cu, inv_cfg, jax.random.PRNGKey(cfg.seed), FLAGS.targets_per_client,
                                   FLAGS.inversion_batch, compiled, FLAGS.min_class_samples)
    if part is not None:
      parts.append(part)
      attacked.append(cu.client)
  if not parts:
    from fedjax_het.errors import ConfigError
    raise ConfigError(f'{label}: no attacked client uploads a vector to invert (prototypes need classes of at least '
                      f'--min_class_samples={FLAGS.min_class_samples} samples); choose other --attack_clients.')
  accuracy = None
  if evaluate:
    state, _ = fed.round(state)
    accuracy = float(fed.evaluate(state)['accuracy'])
  cat = lambda k: np.concatenate([p[k] for p in parts])
  result = {'method': label, 'seed': cfg.seed, 'algorithm': cfg.algorithm, 'round': attacked_round,
            'kind': parts[0]['kind'], 'clients': attacked, 'targets_per_client': [len(p['psnr']) for p in parts],
            'labels': cat('labels'), 'accuracy': accuracy, 'attack_seconds': time.perf_counter() - start,
            **{k: cat(k) for k in METRICS + ('originals', 'references', 'reconstructions')}}
  result['identified'] = np.asarray(inversion.identified(result['reconstructions'], result['references']))
  print(f'{label} seed {cfg.seed}: {result["kind"]}, {len(result["psnr"])} targets, PSNR vs reference '
        f'{inversion.mean_std(result["psnr"])} dB (null {inversion.mean_std(result["null_psnr"])}), best match '
        f'{inversion.mean_std(result["best_psnr"])} (null {inversion.mean_std(result["best_null_psnr"])}), '
        f'identified {100 * result["identified"].mean():.1f} %, accuracy {accuracy}', flush=True)
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  from fedjax_het.run.compilation_cache import use_compilation_cache
  use_compilation_cache(FLAGS.compilation_cache)
  import numpy as np
  from fedjax_het import evaluation as inversion
  from fedjax_het.errors import ConfigError
  from fedjax_het.run.experiment import build_federation
  results = []
  try:
    inv_cfg = inversion.InversionConfig(FLAGS.inversion_steps, FLAGS.inversion_lr, FLAGS.tv_weight, FLAGS.prior,
                                        FLAGS.dip_channels)
    if FLAGS.min_class_samples < 1:
      raise ConfigError(f'--min_class_samples={FLAGS.min_class_samples} must be >= 1.')
    clients = _ints('attack_clients', FLAGS.attack_clients)
    if FLAGS.targets_per_client < 1 or FLAGS.figure_columns < 1:
      raise ConfigError(f'--targets_per_client={FLAGS.targets_per_client} and --figure_columns='
                        f'{FLAGS.figure_columns} must be >= 1.')
    os.makedirs(FLAGS.workdir, exist_ok=True)
    if FLAGS.from_workdir:
      from fedjax_het.run.experiment import restore_run
      cfg, fed, state = restore_run(FLAGS.from_workdir, '--from_workdir')
      results.append(_attack(cfg.algorithm, cfg, fed, state, clients, inv_cfg, FLAGS.evaluate))
      setting = cfg
    else:
      from fedjax_het.run.registry import METHODS
      names = [ALIASES.get(m, m).partition('[')[0] for m in (FLAGS.methods or [FLAGS.algorithm])]
      unknown = [n for n in names if n not in METHODS]
      if unknown:
        raise ConfigError(f'--methods: {", ".join(unknown)} unknown; choose from fedallrep, {", ".join(METHODS)}.')
      base = cli.config_from_flags(algorithms=names)
      if base.rounds < 1:
        raise ConfigError(f'--rounds={base.rounds} must be >= 1: the attacked round is the last one.')
      setting = base
      for label, cfg in _runs(base):
        fed = build_federation(cfg)
        state = fed.init()
        for _ in range(cfg.rounds - 1):
          state, _ = fed.round(state)
        results.append(_attack(label, cfg, fed, state, clients, inv_cfg, FLAGS.evaluate))
  except ConfigError as e:
    raise
  title = (f'Representation inversion on {setting.dataset} ({setting.num_clients} clients, models '
           f'{",".join(setting.models)}, d={setting.feature_dim}), round {results[0]["round"]}, clients '
           f'{",".join(map(str, clients))}; {inv_cfg.prior} prior, {inv_cfg.steps} Adam steps, lr '
           f'{inv_cfg.learning_rate}, TV {inv_cfg.tv_weight}; prototypes of classes with >= '
           f'{FLAGS.min_class_samples} samples')
  table = inversion.leakage_table(results)
  with open(os.path.join(FLAGS.workdir, 'inversion.md'), 'w') as f:
    f.write(f'{title}\n\n{table}')
  arrays = METRICS + ('labels', 'identified')
  keep = ('method', 'seed', 'algorithm', 'round', 'kind', 'clients', 'targets_per_client', 'accuracy',
          'attack_seconds') + arrays
  with open(os.path.join(FLAGS.workdir, 'inversion.json'), 'w') as f:
    json.dump({'title': title, 'runs': [{k: np.asarray(r[k]).tolist() if k in arrays else r[k] for k in keep}
                                        for r in results]}, f, indent=1)
  first = {}
  for r in results:
    first.setdefault(r['method'], r)
  cols = FLAGS.figure_columns
  panels = [(f'{m} ({r["kind"]}, seed {r["seed"]})', r['references'][:cols], r['reconstructions'][:cols])
            for m, r in first.items()]
  inversion.plot_reconstructions(panels, os.path.join(FLAGS.workdir, 'inversion.png'), title)
  print(title)
  print(table)


if __name__ == '__main__':
  cli.app_run(main)
