"""The group engine: stacked client states, local SGD, execution strategies, evaluation."""
from fedjax_het.engine.client_update import client_update
from fedjax_het.engine.federation import (STRATEGIES, Federation, FederationState, default_client_threads,
                                          default_conv, default_eval_batch_size, default_strategy)
from fedjax_het.engine.sharding import CLIENTS_AXIS, client_mesh, place_clients, to_host
from fedjax_het.engine.state import ClientState
from fedjax_het.engine.training import LocalTraining, batch_schedule, sgd_step, train_scan
