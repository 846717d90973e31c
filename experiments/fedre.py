"""FedRE from flags (every other method: experiments/run.py --algorithm=NAME, same flags).

  python experiments/fedre.py --flagfile=experiments/flags/quickstart.flags --workdir=/tmp/fedre_quickstart
"""

from fedjax_het.run import interrupts

interrupts.install(watch=True)  # Ctrl-C or SIGTERM from the first second: a clean stop, or an abort

from absl import flags  # noqa: E402

from fedjax_het.run import cli

cli.define_flags(default_algorithm='fedre')
flags.mark_flag_as_required('workdir')

if __name__ == '__main__':
  cli.app_run(cli.main)
