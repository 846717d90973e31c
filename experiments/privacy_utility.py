"""The privacy-utility trade-off of several methods under client-level DP: final accuracy at each target epsilon.

Each (method, epsilon, seed) is an ordinary run in --workdir/eps<epsilon>/<method>/seed<seed>/, its noise calibrated
to the whole run (--dp_target_epsilon; 'inf' runs without DP). Into --workdir it writes privacy_utility.md (the
table), privacy_utility.json (every run's epsilon spent, noise and accuracy) and privacy_utility.png (one plot, every
method on the same axes). Stopped sweeps continue where they stopped when run again with the same flags.

  python experiments/privacy_utility.py --flagfile=experiments/flags/quickstart_mnist5k.flags --rounds=20 \
      --algorithms=fedre,fedproto,fd,fedavg --baselines=local --epsilons=1,3,8,inf --seeds=0,1,2 \
      --dp_mode=central --workdir=/tmp/privacy_utility

Every other flag is the experiment's (experiments/run.py), the DP flags included (--dp_mode, --dp_clip,
--dp_delta, --dp_parts, --dp_accountant); --algorithm, --seed and --dp_target_epsilon are replaced by the lists.
"""

import sys

from fedjax_het import interrupts

interrupts.install(watch=True, abort_message='aborted ({signal}): finished runs are kept; run the same command again '
                                             'to continue.')

from absl import app, flags, logging  # noqa: E402

from fedjax_het import cli  # noqa: E402
from fedjax_het.compare import parse_entry  # noqa: E402
from fedjax_het.compilation_cache import use_compilation_cache  # noqa: E402
from fedjax_het.errors import ConfigError  # noqa: E402
from fedjax_het.privacy.tradeoff import run_tradeoff, write_tradeoff  # noqa: E402

cli.define_flags(default_algorithm='fedre')
flags.DEFINE_list('algorithms', ['fedre', 'fedproto', 'fd', 'fedavg'], 'Methods (variants NAME[flag=value;...] as '
                  'in experiments/compare.py).')
flags.DEFINE_list('baselines', [], 'Methods run without DP only, drawn as a level (e.g. local: no uploads).')
flags.DEFINE_list('epsilons', ['1', '3', '8', 'inf'], 'Target epsilons of the whole run at --dp_delta; inf: no DP.')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (each gives its own partition and initialisation).')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  try:
    seeds, epsilons = [int(s) for s in FLAGS.seeds], [float(e) for e in FLAGS.epsilons]
  except ValueError:
    sys.exit(f'error: --seeds={",".join(FLAGS.seeds)} must be integers and --epsilons={",".join(FLAGS.epsilons)} '
             f'numbers (inf: without DP), e.g. --seeds=0,1,2 --epsilons=1,3,8,inf.')
  use_compilation_cache(FLAGS.compilation_cache)
  try:
    if FLAGS.dp_mode != 'off' and not FLAGS.dp_noise_multiplier and not FLAGS.dp_target_epsilon:
      FLAGS.dp_target_epsilon = 1.0  # a placeholder the config's check accepts; each point sets its own
    base = cli.config_from_flags(algorithms=[parse_entry(a)[0] for a in FLAGS.algorithms + FLAGS.baselines])
    points = run_tradeoff(base, FLAGS.algorithms, epsilons, seeds, FLAGS.workdir, progress=FLAGS.progress,
                          baselines=FLAGS.baselines)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  except KeyboardInterrupt:
    interrupts.exit_now(f'interrupted: finished runs are kept in {FLAGS.workdir}; run the same command again to '
                        f'continue.', interrupts.exit_code())
  title = (f'{base.dataset}, {base.num_clients} clients, {base.rounds} rounds, DP {base.dp_mode}, clip '
           f'{base.dp_clip:g}, delta {base.dp_delta:g}, seeds {seeds}')
  print(write_tradeoff(points, FLAGS.workdir, title))


if __name__ == '__main__':
  app.run(main)
