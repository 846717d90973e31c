"""How a federation's rounds are executed: strategy, convolution kernels, devices, chunking and threads. None of it
changes a number beyond float32 rounding (the executors and kernels are tested equal to that); the convolution
formulation and oneDNN's threads decide that rounding, so a run's defaults on CPU depend on whether oneDNN is
installed and on the core count. Every default is decided once, by `resolve`."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax

from fedjax_het.engine.executor import STRATEGIES, Executor
from fedjax_het.engine.sequential_executor import SequentialExecutor
from fedjax_het.engine.vmap_executor import VmapExecutor
from fedjax_het.engine.sharding import CLIENTS_AXIS, place_replicated
from fedjax_het.errors import ConfigError
from fedjax_het.kernels import onednn
from fedjax_het.models.conv import CONV_IMPLS


DEFAULT_BUDGET_FRACTION = 0.75


def default_memory_budget(backend: str) -> Optional[int]:
  """DEFAULT_BUDGET_FRACTION of the first device's memory where the backend reports it (GPUs do), else None."""
  if backend == 'cpu':
    return None
  stats = jax.devices()[0].memory_stats() or {}
  limit = stats.get('bytes_limit')
  return int(DEFAULT_BUDGET_FRACTION * limit) if limit else None


@dataclasses.dataclass(frozen=True)
class ExecutionConfig:
  """strategy: 'vmap' (`VmapExecutor`) or 'sequential' (`SequentialExecutor`); None: sequential on CPU (measured
    faster there, docs/performance.md), vmap on GPU/TPU.
  conv: 'xla', 'im2col', 'auto', 'gemm' (models/conv.py), 'onednn' (kernels/onednn.py, CPU only) or 'pallas'
    (kernels/pallas_conv.py, GPU only); None: on CPU
    onednn where oneDNN is installed, else im2col under vmap (grouped convolutions are slow there) and auto for
    sequential; im2col on GPU under vmap (measured, benchmarks/vmap_conv.py), xla otherwise.
  single_client_conv: resolved, not set: the convolution of an architecture group of one client. Its chunks are
    one client wide, where XLA's convolution under vmap stays an ungrouped one (cuDNN's on a GPU), so with conv
    unset a GPU runs such a group with xla and the others with im2col (chosen for that reason; not yet measured
    against im2col there: docs/performance.md); otherwise it is conv.
  client_mesh: a one-axis ('clients') mesh of D > 1 devices over which the vmap executor lays each group's clients
    (`engine.client_mesh`); None: one device.
  chunk_size: the widest chunk of clients in one vmapped call (0: `VmapExecutor.DEFAULT_MAX_WIDTH`); the
    executor cuts a round's participants into chunks of similar work (`engine.chunks`), widths from a ladder up to
    this; a multiple of the mesh's devices.
  scan_unroll: local steps per loop iteration of the vmap executor's lax.scan.
  client_threads: clients the sequential executor runs at once, one host thread each; None: 2, at most the cores.
  eval_batch_size: rows per eval-mode pass (representations, evaluation); None: on CPU 64 with oneDNN's
    convolutions and 32 with the others, whose larger passes spill the im2col patches out of cache
    (benchmarks/cpu_kernels.py --parts=represent); 256 on GPU/TPU.
  memory_budget: bytes of device memory a vmapped call may use, its clients' states and rows included: each
    group's widest chunk is the widest whose compiled call fits (`VmapExecutor.budget_width`, from XLA's memory
    analysis); None: DEFAULT_BUDGET_FRACTION of the device's memory where the backend reports it (GPU), else no
    bound. Ignored when chunk_size is set.
  stream_clients: vmap strategy: client states and rows stay on the host; each chunk's are copied to the device
    for its call (the next chunk's while it computes) and its states copied back, so that the device holds one
    chunk's data, not the population's (same numbers).
  onednn_threads: OpenMP threads of each oneDNN convolution (conv='onednn'); None: under the sequential strategy
    the cores divided among the client threads (at least 1), so that they fill the cores without oversubscribing
    them, but all cores where no architecture group has two clients (no two clients then run at once: the
    papers' one-client-per-architecture settings); under vmap (one host thread) all cores. The numbers depend on
    it (oneDNN splits some kernel-gradient sums among its threads): set it to keep them while changing
    client_threads.
  group_threads: architecture groups initialised, and run in the rounds and evaluations where their programs
    compile (a phase's first), at once, one host thread each, so that their compilations overlap (the numbers do
    not depend on it); None: the cores, and 1 where the programs span several devices or processes (their
    collectives must be issued in one order everywhere).
  scan_blocks: a model's runs of identical blocks (a ResNet stage's blocks after its first, a ViT's encoder
    blocks) applied as one scanned block, traced and compiled once (models/repeat.py); the same parameters and
    numbers up to float32 rounding. On the CPU the start of a deep architecture shortened by a few seconds and its
    rounds took 1.3-1.55x as long (docs/performance.md); off by default, for a device to measure
    (benchmarks/xla_flags.py).
  """
  strategy: Optional[str] = None
  conv: Optional[str] = None
  client_mesh: Optional[jax.sharding.Mesh] = None
  chunk_size: int = 0
  scan_unroll: int = 1
  client_threads: Optional[int] = None
  eval_batch_size: Optional[int] = None
  onednn_threads: Optional[int] = None
  memory_budget: Optional[int] = None
  stream_clients: bool = False
  group_threads: Optional[int] = None
  scan_blocks: bool = False
  single_client_conv: Optional[str] = dataclasses.field(default=None, repr=False)

  def __post_init__(self):
    if self.strategy is not None and self.strategy not in STRATEGIES:
      raise ConfigError(f'ExecutionConfig.strategy={self.strategy!r} is unknown; choose one of '
                        f'{", ".join(STRATEGIES)}.')
    if self.conv is not None and self.conv not in CONV_IMPLS:
      raise ConfigError(f'ExecutionConfig.conv={self.conv!r} is unknown; choose one of {", ".join(CONV_IMPLS)}.')
    mesh = self.client_mesh
    if mesh is not None and mesh.axis_names != (CLIENTS_AXIS,):
      raise ConfigError(f'ExecutionConfig.client_mesh must have the single axis {CLIENTS_AXIS!r}; got '
                        f'{mesh.axis_names}. Fix: build it with fedjax_het.engine.client_mesh().')
    if self.chunk_size < 0:
      raise ConfigError(f'ExecutionConfig.chunk_size={self.chunk_size} must be >= 0 (0: the default widest '
                        f'call).')
    if self.scan_unroll < 1:
      raise ConfigError(f'ExecutionConfig.scan_unroll={self.scan_unroll} must be >= 1 (local steps per loop '
                        f'iteration).')
    if self.client_threads is not None and self.client_threads < 1:
      raise ConfigError(f'ExecutionConfig.client_threads={self.client_threads} must be >= 1.')
    if self.group_threads is not None and self.group_threads < 1:
      raise ConfigError(f'ExecutionConfig.group_threads={self.group_threads} must be >= 1 (None: the cores).')
    if self.onednn_threads is not None and self.onednn_threads < 1:
      raise ConfigError(f'ExecutionConfig.onednn_threads={self.onednn_threads} must be >= 1 (None: the cores divided '
                        f'among the client threads).')
    cores = os.cpu_count() or 1
    if self.onednn_threads is not None and self.onednn_threads > cores:
      raise ConfigError(f'ExecutionConfig.onednn_threads={self.onednn_threads} is more than this machine\'s {cores} '
                        f'cores (OpenMP cannot start that many threads per convolution). Fix: at most '
                        f'{cores}, or leave it unset (the cores divided among the client threads).')
    if self.memory_budget is not None and self.memory_budget < 1:
      raise ConfigError(f'ExecutionConfig.memory_budget={self.memory_budget} must be a positive number of bytes '
                        f'(None: a share of the device\'s memory).')
    if self.eval_batch_size is not None and self.eval_batch_size < 1:
      raise ConfigError(f'ExecutionConfig.eval_batch_size={self.eval_batch_size} must be >= 1 (None: the '
                        f'backend default).')
    devices = self.num_devices
    if self.stream_clients and (self.strategy == 'sequential' or devices > 1):
      raise ConfigError(f'ExecutionConfig.stream_clients=True streams chunks of clients into vmapped calls on one '
                        f'device; it runs with ExecutionConfig.strategy=\'vmap\' and no client mesh (got strategy '
                        f'{self.strategy!r}, {devices} device(s)). Fix: strategy=\'vmap\' and num_devices=1, or '
                        f'stream_clients=False.')
    if devices > 1 and self.strategy == 'sequential':
      raise ConfigError(f'ExecutionConfig.client_mesh={devices} devices: sharding clients over devices needs '
                        f'ExecutionConfig.strategy=\'vmap\' (got {self.strategy!r}). Fix: '
                        f'ExecutionConfig.strategy=\'vmap\', or ExecutionConfig.client_mesh=None.')
    if self.chunk_size and devices > 1 and self.chunk_size % devices:
      raise ConfigError(f'ExecutionConfig.chunk_size={self.chunk_size} must be a multiple of the {devices} devices '
                        f'of the client mesh, so every chunk splits evenly. Fix: chunk_size='
                        f'{devices * max(1, self.chunk_size // devices)}.')

  @property
  def num_devices(self) -> int:
    """Devices the clients are laid over (1 without a mesh)."""
    return 1 if self.client_mesh is None else self.client_mesh.size

  def resolve(self, backend: Optional[str] = None, largest_group: Optional[int] = None) -> 'ExecutionConfig':
    """This configuration with every default decided for `backend` (default: JAX's) and, where known, the
    number of clients in the largest architecture group: the one place they are."""
    cpu = (backend or jax.default_backend()) == 'cpu'
    strategy = self.strategy or ('sequential' if cpu else 'vmap')
    if (self.num_devices > 1 or self.stream_clients) and self.strategy is None:
      strategy = 'vmap'
    # oneDNN's custom call under vmap is a loop over the clients, which XLA cannot split over a client mesh.
    fallback = 'im2col' if strategy == 'vmap' else 'auto'
    wants_onednn = strategy == 'sequential' or self.num_devices == 1
    backend = backend or jax.default_backend()
    # GPUs run XLA's vmapped (grouped) convolutions several times slower than im2col (docs/performance.md,
    # benchmarks/vmap_conv.py); TPUs are not measured and keep XLA's.
    accelerator = 'im2col' if backend == 'gpu' and strategy == 'vmap' else 'xla'
    conv = self.conv or (('onednn' if wants_onednn and onednn.unavailable_reason() is None else fallback) if cpu
                         else accelerator)
    if conv == 'onednn':
      if not cpu:
        raise ConfigError(f'ExecutionConfig.conv=\'onednn\' runs on the CPU only (backend: '
                          f'{backend or jax.default_backend()}). Fix: conv=\'xla\' (or leave it unset).')
      if onednn.unavailable_reason() is not None:
        raise onednn.OneDNNUnavailable(f'ExecutionConfig.conv=\'onednn\': {onednn.unavailable_reason()}')
    if conv == 'pallas' and backend != 'gpu':
      raise ConfigError(f'ExecutionConfig.conv=\'pallas\' compiles Triton kernels for GPUs (backend: {backend}); '
                        f'elsewhere it would run Pallas\'s interpreter, far slower than XLA. Fix: conv=\'im2col\' '
                        f'(or leave it unset).')
    if conv == 'pallas' and self.num_devices > 1:
      raise ConfigError(f'ExecutionConfig.conv=\'pallas\' with num_devices={self.num_devices}: XLA cannot split a '
                        f'Pallas kernel over a client mesh (it would gather every client onto each device). Fix: '
                        f'conv=\'im2col\', or num_devices=1.')
    threads = self.client_threads or max(1, min(2, os.cpu_count() or 1))
    mesh = self.client_mesh if self.num_devices > 1 else None
    budget = self.memory_budget or default_memory_budget(backend)
    spans = self.num_devices > 1 or jax.process_count() > 1
    if spans and (self.group_threads or 1) > 1:
      raise ConfigError(f'ExecutionConfig.group_threads={self.group_threads}: programs over several devices or '
                        f'processes must be issued in one order everywhere, so their groups run one at a time. Fix: '
                        f'group_threads=1 (or leave it unset).')
    groups = self.group_threads or (1 if spans else os.cpu_count() or 1)
    single = 'xla' if self.conv is None and conv == 'im2col' and backend == 'gpu' and mesh is None else conv
    # Clients that run at once, sharing the cores among their convolutions: none share where no group has two.
    at_once = threads if strategy == 'sequential' and largest_group != 1 else 1
    return dataclasses.replace(self, strategy=strategy, conv=conv, client_mesh=mesh, client_threads=threads,
                               single_client_conv=single,
                               memory_budget=budget, group_threads=groups,
                               eval_batch_size=self.eval_batch_size or ((64 if conv == 'onednn' else 32) if cpu
                                                                        else 256),
                               onednn_threads=self.onednn_threads or max(1, (os.cpu_count() or 1) // at_once))

  def describe(self, backend: Optional[str] = None) -> str:
    """One line naming the backend and what this resolved configuration runs with (printed at a run's start)."""
    backend = backend or jax.default_backend()
    count, unit = (os.cpu_count(), 'core') if backend == 'cpu' else (jax.device_count(), 'device')
    where = f'{backend} ({count} {unit}{"s" if count != 1 else ""})'
    conv = self.conv
    if conv == 'onednn':
      conv += f' (oneDNN {onednn.version()}, {self.onednn_threads} thread{"s" if self.onednn_threads > 1 else ""} each)'
    elif conv in ('auto', 'im2col') and backend == 'cpu' and onednn.unavailable_reason() is not None:
      reason = onednn.unavailable_reason()
      conv += (f' (oneDNN\'s convolutions would be faster: {onednn.INSTALL})' if 'was not found' in reason else
               ' (oneDNN\'s convolutions would be faster but do not load: see '
               'fedjax_het.kernels.onednn.unavailable_reason())')
    if self.single_client_conv not in (None, self.conv):
      conv += f' ({self.single_client_conv} in groups of one client)'
    how = f'strategy={self.strategy}, conv={conv}, eval_batch_size={self.eval_batch_size}'
    if self.strategy == 'sequential':
      how += f', client_threads={self.client_threads}'
    else:
      widest = self.chunk_size or f'at most {VmapExecutor.DEFAULT_MAX_WIDTH}'
      budget = f', memory_budget={self.memory_budget / 2**30:.1f} GiB' if self.memory_budget else ''
      stream = ', clients streamed from the host' if self.stream_clients else ''
      how += f', chunk_size={widest}{budget}, devices={self.num_devices}{stream}'
    return f'{where}: {how}'

  def apply_process_settings(self) -> None:
    """Sets what this resolved configuration needs of the process (oneDNN's threads per convolution, a setting of
    the whole process): a `Federation` calls it when it is built and at the start of each round and evaluation,
    so that federations built in one process each run with their own."""
    if self.conv == 'onednn':
      onednn.set_threads(self.onednn_threads)

  def executor(self) -> Executor:
    """The executor of a resolved configuration (the process settings applied)."""
    self.apply_process_settings()
    if self.strategy == 'vmap':
      return VmapExecutor(self.eval_batch_size, self.chunk_size, self.scan_unroll, self.num_devices,
                          lambda tree: place_replicated(jax.device_put(tree), self.client_mesh), self.memory_budget,
                          self.stream_clients)
    return SequentialExecutor(self.eval_batch_size, self.client_threads)
