"""Any method from flags: the same flags, outputs and checkpoints as experiments/fedre.py.

  python experiments/run.py --algorithm=fedproto --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/proto

--algorithm: one of the registered methods (fedjax_het.run.registry.METHODS): {methods}. Flag files describe a setting
and name no method; flags given after --flagfile override the file's.
"""

from fedjax_het.run import interrupts

interrupts.install(watch=True)  # Ctrl-C or SIGTERM from the first second: a clean stop, or an abort

from absl import flags  # noqa: E402

from fedjax_het.run import cli
from fedjax_het.run.registry import METHODS

__doc__ = __doc__.format(methods=', '.join(METHODS))  # --help lists what is registered, never a stale copy
cli.define_flags(default_algorithm=None)
flags.mark_flags_as_required(['algorithm', 'workdir'])

if __name__ == '__main__':
  cli.app_run(cli.main)
