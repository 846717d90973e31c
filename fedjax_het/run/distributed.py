"""The processes of one multi-controller run: JAX's runtime joined, one process that writes, and decisions they
all take together.

A run over several processes (hosts of a GPU cluster, a TPU pod slice, or processes on one machine) is JAX's
multi-controller SPMD: every process runs the same program from the same flags and seed, builds the same
`Federation`, and computes on its own devices; the 'clients' mesh (`engine.client_mesh`) spans all of them.
`initialize` joins the processes: from the variables `fedjax_het.run.launch` sets (or a job script sets the same way),
or else by JAX's detection of the cluster (SLURM, Open MPI, Cloud TPU). On CPU, cross-process collectives run
through gloo.

Everything every process must do alike (each round, each host read, each checkpoint restore) they all do; only
process 0 writes the workdir's files (`is_writer`). What one process learns alone (a stop signal) becomes a
decision of all through `any_process`, so no process leaves a collective the others are waiting in.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from fedjax_het.errors import ConfigError

# What `fedjax_het.run.launch` (or a job script) sets for each process: JAX's own coordinator variable, and the
# process count and index, which jax.distributed.initialize only detects on the clusters it knows.
COORDINATOR = 'JAX_COORDINATOR_ADDRESS'
NUM_PROCESSES = 'FEDJAX_HET_NUM_PROCESSES'
PROCESS_ID = 'FEDJAX_HET_PROCESS_ID'
# Where process 0's coordination service listens (host:port); default the coordinator address itself. Set it on a
# machine reached through another address than its own interface's (e.g. behind NAT).
COORDINATOR_BIND = 'FEDJAX_HET_COORDINATOR_BIND_ADDRESS'


def initialize(timeout_seconds: int = 300) -> None:
  """Joins this process to the run's others (`jax.distributed.initialize`), before any computation. With
  FEDJAX_HET_NUM_PROCESSES and FEDJAX_HET_PROCESS_ID set (and JAX_COORDINATOR_ADDRESS, host:port of process 0) they
  are used, process 0's coordination service listening on that address only (or on
  FEDJAX_HET_COORDINATOR_BIND_ADDRESS); otherwise JAX detects the cluster. CPU collectives use gloo. A ConfigError
  names the variables when neither works."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  num, index, coordinator = os.environ.get(NUM_PROCESSES), os.environ.get(PROCESS_ID), os.environ.get(COORDINATOR)
  try:
    if num is not None or index is not None:
      if not (num and index and coordinator):
        raise ConfigError(f'--distributed: set all of {COORDINATOR} (host:port of process 0), {NUM_PROCESSES} and '
                          f'{PROCESS_ID}, or none of them on a cluster JAX detects (SLURM, Open MPI, Cloud TPU). '
                          f'Fix: start the processes with python -m fedjax_het.run.launch.')
      # The coordinator listens on the address the processes are given, not on every interface (JAX's default):
      # its service is unauthenticated, so it is reachable only where the run means it to be.
      jax.distributed.initialize(coordinator, int(num), int(index), initialization_timeout=timeout_seconds,
                                 coordinator_bind_address=os.environ.get(COORDINATOR_BIND, coordinator))
    else:
      jax.distributed.initialize(initialization_timeout=timeout_seconds)
  except ConfigError:
    raise
  except (ValueError, RuntimeError) as e:
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if any(s in str(e).lower() for s in ('address already in use', 'failed to bind', 'address in use')):
      raise ConfigError(f'--distributed: process 0 cannot listen on {coordinator} ({first}): the port is in use. '
                        f'Fix: another port in {COORDINATOR} (python -m fedjax_het.run.launch picks a free one unless '
                        f'--port is given).') from None
    raise ConfigError(f'--distributed: the processes could not be joined ({first}). Fix: start them with python -m '
                      f'fedjax_het.run.launch, or set {COORDINATOR}, {NUM_PROCESSES} and {PROCESS_ID} for each.'
                      ) from None


def is_writer() -> bool:
  """Whether this process writes the run's outputs (process 0; the only one of a one-process run)."""
  return jax.process_index() == 0


def any_process(flag: bool) -> bool:
  """Whether `flag` is true in any process of the run (every process must call it at the same point)."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils
  return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def barrier(name: str) -> None:
  """Waits until every process of the run has reached the barrier `name`."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(name)
