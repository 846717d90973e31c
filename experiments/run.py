"""Any method from flags: the same flags, outputs and checkpoints as experiments/fedre.py.

  python experiments/run.py --algorithm=fedproto --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/proto

--algorithm: fedre, local, fedavg (grouped), lg_fedavg, fedproto, fedgh, fedtgp, fd, fedgen, fml. Flag files
describe a setting and name no method; flags given after --flagfile override the file's.
"""

from fedjax_het import interrupts

interrupts.install(watch=True)  # Ctrl-C or SIGTERM from the first second: a clean stop, or an abort

from absl import app, flags  # noqa: E402

from fedjax_het import cli

cli.define_flags(default_algorithm=None)
flags.mark_flags_as_required(['algorithm', 'workdir'])

if __name__ == '__main__':
  app.run(cli.main)
