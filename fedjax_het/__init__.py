"""fedjax_het: model-heterogeneous federated learning in JAX/Flax."""
import os as _os

__version__ = '0.1.0'


def _disable_xla_cpu_concurrency_scheduler() -> None:
  """XLA:CPU's concurrency-optimized scheduler deadlocks on some vmapped client updates (FedKD's, with a dense
  client model and a convolutional mentee: the process waits forever at 0% CPU); turning it off costs nothing
  measurable on the CPU step (benchmarks/cpu_kernels.py --parts=step,federation_step, docs/performance.md). XLA reads
  XLA_FLAGS when its backend starts, so this only takes effect when fedjax_het is imported before the first JAX
  computation; a value the user set for the flag is kept."""
  flag = '--xla_cpu_enable_concurrency_optimized_scheduler'
  current = _os.environ.get('XLA_FLAGS', '')
  if flag not in current:
    _os.environ['XLA_FLAGS'] = f'{current} {flag}=false'.strip()


_disable_xla_cpu_concurrency_scheduler()
