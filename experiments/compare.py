"""Several methods on one setting, with the same seeds and partitions: a table and a plot of their accuracy.

It writes a Markdown table (comparison.md), comparison.json and one accuracy-vs-round plot (comparison.png) into
--workdir.

  python experiments/compare.py --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/compare \
      --algorithms=fedre,local,fedavg,lg_fedavg,fedproto,fedgh,fedtgp,fd --seeds=0,1,2

Every other flag is the experiment's (experiments/run.py); --algorithm and --seed are replaced by the lists. An
entry NAME[flag=value;flag=value] is a variant of a method's hyperparameters, e.g. 'gefl[gefl_generator=cvae]'.
Stopped comparisons continue where they stopped when run again with the same flags.
"""

import sys

from fedjax_het import interrupts

# Ctrl-C or SIGTERM from the first second: a clean stop, or an abort
interrupts.install(watch=True, abort_message='aborted ({signal}): finished runs are kept; run the same command again '
                                             'to continue.')

from absl import app, flags, logging  # noqa: E402

from fedjax_het import cli
from fedjax_het.compilation_cache import use_compilation_cache
from fedjax_het.compare import parse_entry, run_comparison, write_comparison
from fedjax_het.errors import ConfigError

cli.define_flags(default_algorithm='fedre')
flags.DEFINE_list('algorithms', ['fedre', 'local', 'fedavg', 'lg_fedavg', 'fedproto', 'fedgh', 'fedtgp', 'fd'],
                  'Methods to compare.')
flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds (each gives its own partition and initialisation).')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  try:
    seeds = [int(s) for s in FLAGS.seeds]
  except ValueError:
    sys.exit(f'error: --seeds={",".join(FLAGS.seeds)} must be integers, e.g. --seeds=0,1,2.')
  use_compilation_cache(FLAGS.compilation_cache)
  try:
    base = cli.config_from_flags(algorithms=[parse_entry(a)[0] for a in FLAGS.algorithms])
    results = run_comparison(base, FLAGS.algorithms, seeds, FLAGS.workdir, progress=FLAGS.progress,
                             tensorboard=FLAGS.tensorboard)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  except KeyboardInterrupt:
    interrupts.exit_now(f'interrupted: finished runs are kept in {FLAGS.workdir}; run the same command again to '
                        f'continue.', interrupts.exit_code())
  title = f'{base.dataset}, {base.partition}, {base.num_clients} clients, {base.rounds} rounds, seeds {seeds}'
  print(write_comparison(results, FLAGS.workdir, title))


if __name__ == '__main__':
  app.run(main)
