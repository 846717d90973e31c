"""The group engine: architecture groups of stacked clients, executors, the round, evaluation and accounting."""
from fedjax_het.core import ClientState
from fedjax_het.engine.client import run_client, score_client
from fedjax_het.engine.execution import ExecutionConfig
from fedjax_het.engine.executor import STRATEGIES
from fedjax_het.engine.sequential_executor import SequentialExecutor
from fedjax_het.engine.vmap_executor import VmapExecutor
from fedjax_het.engine.federation import Federation, FederationState
from fedjax_het.engine.groups import ModelConfig
from fedjax_het.engine.sharding import CLIENTS_AXIS, client_mesh, place_clients, to_host
from fedjax_het.local_training import LocalTraining, batch_schedule
