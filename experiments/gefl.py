"""GeFL from flags; every other method: experiments/run.py --algorithm=NAME, same flags.

GeFL: "GeFL: Model-Agnostic Federated Learning with Generative Models".

  python experiments/gefl.py --flagfile=experiments/flags/gefl_mnist5k.flags --workdir=/tmp/gefl_mnist5k
"""

from fedjax_het.run import interrupts

interrupts.install(watch=True)  # Ctrl-C or SIGTERM from the first second: a clean stop, or an abort

from absl import flags  # noqa: E402

from fedjax_het.run import cli

cli.define_flags(default_algorithm='gefl')
flags.mark_flag_as_required('workdir')

if __name__ == '__main__':
  cli.app_run(cli.main)
