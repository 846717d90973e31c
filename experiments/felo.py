"""Felo, Velo and FedHe from flags (--algorithm=felo|velo|fedhe).

Felo and Velo: "Exploiting Features and Logits in Heterogeneous Federated Learning".

Every other method: experiments/run.py --algorithm=NAME, with the same flags.

  python experiments/felo.py --flagfile=experiments/flags/felo_mnist5k.flags --workdir=/tmp/felo_mnist5k
"""

from fedjax_het.run import interrupts

interrupts.install(watch=True)  # Ctrl-C or SIGTERM from the first second: a clean stop, or an abort

from absl import flags  # noqa: E402

from fedjax_het.run import cli

cli.define_flags(default_algorithm='felo')
flags.mark_flag_as_required('workdir')

if __name__ == '__main__':
  cli.app_run(cli.main)
