"""Several methods on one setting, with the same seeds and partitions: a table and a plot of their accuracy.

It writes a Markdown table (comparison.md), comparison.json and one accuracy-vs-round plot (comparison.png) into
--workdir.

  python experiments/compare.py --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/compare \
      --algorithms=fedre,local,fedavg,lg_fedavg,fedproto,fedgh,fedtgp,fd --seeds=0,1,2

With --epsilons, the privacy-utility trade-off instead (docs/privacy.md): every method under client-level DP
(--dp_mode) at each target epsilon of the whole run ('inf': without DP; --baselines run only so), each an ordinary
run in --workdir/eps<epsilon>/<method>/seed<seed>/, and privacy_utility.md, .json and .png (final accuracy against
epsilon, every method on the same axes):

  python experiments/compare.py --flagfile=experiments/flags/quickstart_mnist5k.flags --rounds=20 \
      --algorithms=fedre,fedproto,fd,fedavg --baselines=local --epsilons=1,3,8,inf --dp_mode=central \
      --seeds=0,1,2 --workdir=/tmp/privacy_utility

Every other flag is the experiment's (experiments/run.py); --algorithm and --seed are replaced by the lists. An
entry NAME[flag=value;flag=value] is a variant of a method's hyperparameters, e.g. 'gefl[gefl_generator=cvae]'.
Stopped comparisons continue where they stopped when run again with the same flags.
"""


from fedjax_het.run import interrupts

# Ctrl-C or SIGTERM from the first second: a clean stop, or an abort
interrupts.install(watch=True, abort_message='aborted ({signal}): finished runs are kept; run the same command again '
                                             'to continue.')

from absl import app, flags, logging  # noqa: E402

from fedjax_het.errors import ConfigError
from fedjax_het.run import cli
from fedjax_het.run.compare import parse_entry, run_comparison, write_comparison
from fedjax_het.run.compilation_cache import use_compilation_cache
from fedjax_het.run.config import flags_named
from fedjax_het.run.tradeoff import run_tradeoff, write_tradeoff

cli.define_flags(default_algorithm='fedre')
flags.DEFINE_list('algorithms', ['fedre', 'local', 'fedavg', 'lg_fedavg', 'fedproto', 'fedgh', 'fedtgp', 'fd'],
                  'Methods to compare.')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (each gives its own partition and initialisation).')
flags.DEFINE_list('epsilons', [], 'The privacy-utility trade-off instead of a comparison: target epsilons of the '
                  'whole run at --dp_delta under --dp_mode (inf: without DP).')
flags.DEFINE_list('baselines', [], 'With --epsilons: methods run without DP only, drawn as a level (e.g. local).')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  try:
    seeds = [int(s) for s in FLAGS.seeds]
    epsilons = [float(e) for e in FLAGS.epsilons]
  except ValueError:
    raise ConfigError(f'--seeds={",".join(FLAGS.seeds)} must be integers and --epsilons={",".join(FLAGS.epsilons)} '
                      f'numbers (inf: without DP). Fix: e.g. --seeds=0,1,2 --epsilons=1,3,8,inf.') from None
  use_compilation_cache(FLAGS.compilation_cache)
  names = [parse_entry(a)[0] for a in FLAGS.algorithms + FLAGS.baselines]
  try:
    with flags_named():  # errors raised while the runs build or trace name the flags
      print(_tradeoff(epsilons, seeds, names) if epsilons else _comparison(seeds, names))
  except ConfigError as e:
    raise
  except KeyboardInterrupt:
    interrupts.exit_now(f'interrupted: finished runs are kept in {FLAGS.workdir}; run the same command again to '
                        f'continue.', interrupts.exit_code())


def _title(base, seeds) -> str:
  drawn = ('' if base.join_ratio == 1 else f', {base.join_ratio:g} of them a round' if base.participation == 'fixed'
           else f', each with probability {base.join_ratio:g} a round (Poisson)')
  return (f'{base.dataset}, {base.partition}, {base.num_clients} clients{drawn}, {base.rounds} rounds, '
          f'seeds {seeds}')


def _comparison(seeds, names) -> str:
  base = cli.config_from_flags(algorithms=names)
  results = run_comparison(base, FLAGS.algorithms, seeds, FLAGS.workdir, progress=FLAGS.progress,
                           tensorboard=FLAGS.tensorboard)
  return write_comparison(results, FLAGS.workdir, _title(base, seeds))


def _tradeoff(epsilons, seeds, names) -> str:
  """Each point sets its own noise: the base runs without DP."""
  for flag in ('dp_noise_multiplier', 'dp_target_epsilon'):
    if FLAGS[flag].present and FLAGS[flag].value:
      raise ConfigError(f'--{flag}={FLAGS[flag].value} with --epsilons: each point of the trade-off calibrates its '
                        f'noise to its own epsilon, so this value would be ignored. Fix: leave --{flag} out (or '
                        f'drop --epsilons to compare the methods at that noise).')
  base = cli.config_from_flags(algorithms=names, dp_mode='off', dp_parts=(), dp_target_epsilon=0.0,
                               dp_noise_multiplier=0.0)
  points = run_tradeoff(base, FLAGS.dp_mode, FLAGS.algorithms, epsilons, seeds, FLAGS.workdir,
                        progress=FLAGS.progress, baselines=FLAGS.baselines, parts=FLAGS.dp_parts)
  return write_tradeoff(points, FLAGS.workdir, f'{_title(base, seeds)}; DP {FLAGS.dp_mode}, clip {base.dp_clip:g}, '
                                               f'delta {base.dp_delta:g}')


if __name__ == '__main__':
  cli.app_run(main)
