"""The experiment entry point (experiments/run.py) with the test suite's XLA settings, for tests/test_multiprocess.py;
with FEDJAX_HET_TEST_KILL_AT_ROUND=R, process 1 of a multi-process run kills itself with SIGKILL as round R starts
(after the checkpoint of round R - 1), as a crashed host would.

  python -m fedjax_het.run.launch --num_processes=2 --cpu_devices=2 tests/multiprocess_driver.py FLAGS...
"""

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import conftest  # noqa: F401,E402 (the test suite's XLA settings and compilation cache)

from fedjax_het.run import interrupts  # noqa: E402

interrupts.install(watch=True)

from absl import app  # noqa: E402

from fedjax_het.engine.federation import Federation  # noqa: E402
from fedjax_het.run import cli  # noqa: E402

cli.define_flags()

if __name__ == '__main__':
  kill_at = int(os.environ.get('FEDJAX_HET_TEST_KILL_AT_ROUND', 0))
  if kill_at and os.environ.get('FEDJAX_HET_PROCESS_ID') == '1':
    original_round = Federation.round

    def round_or_die(self, state):
      if int(state.round) == kill_at - 1:
        os.kill(os.getpid(), signal.SIGKILL)
      return original_round(self, state)
    Federation.round = round_or_die
  app.run(cli.main)
