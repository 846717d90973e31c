"""FedRE (and the Local / grouped-FedAvg baselines) from flags.

  python experiments/fedre.py --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/fedre_quickstart
"""

import json
import sys

from absl import app, flags, logging

from fedjax_het import cli
from fedjax_het.errors import ConfigError
from fedjax_het.experiment import train_and_evaluate

cli.define_flags(default_algorithm='fedre')
flags.mark_flag_as_required('workdir')
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO.
  if FLAGS.distributed:
    import jax
    jax.distributed.initialize()  # before any computation; coordinator and process ids from the environment
  try:
    summary = train_and_evaluate(cli.config_from_flags(), FLAGS.workdir, resume=FLAGS.resume,
                                 progress=FLAGS.progress)
  except ConfigError as e:
    sys.exit(f'error: {e}')
  except KeyboardInterrupt:
    sys.exit(f'interrupted: outputs so far are in {FLAGS.workdir}; continue with the same flags plus --resume.')
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2))


if __name__ == '__main__':
  app.run(main)
