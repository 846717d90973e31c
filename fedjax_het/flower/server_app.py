"""The ServerApp: a fedjax_het run whose clients are Flower SuperNodes, with the outputs of a simulation run
(metrics.jsonl, summary.json, plots, orbax checkpoints and --resume) in its workdir.

Run config (flwr run ... --run-config '...'): flagfile (the run's flags, as experiments/ takes them; absolute
path on the SuperLink's machine), workdir (its outputs there), resume (continue from its last checkpoint),
round-timeout (seconds a round waits for its replies, default 600), connect-timeout (seconds to wait for the
nodes, default 120), run-name (the folder of the nodes' states; give each run its own), compilation-cache
(XLA's persistent compilation cache, default ~/.cache/fedjax_het/xla).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from absl import flags, logging
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedjax_het import cli
from fedjax_het.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache
from fedjax_het.experiment import train_and_evaluate
from fedjax_het.flower.node import deployed_config
from fedjax_het.errors import ConfigError
from fedjax_het.flower.rounds import FlowerRounds

app = ServerApp()


def config_from_flagfile(path: str):
  """The `ExperimentConfig` of a flag file, as the experiment entry points read it."""
  fv = flags.FlagValues()
  cli.define_flags(flag_values=fv)
  cli.parse_flags(['flower', f'--flagfile={path}'], fv)
  return cli.config_from_flags(fv)


def run_config_value(run_config: dict, name: str, default: Optional[Any] = None) -> Any:
  """A value of the Flower run config, or `default`; a ConfigError naming it when it is required and missing."""
  if run_config.get(name) not in (None, ''):
    return run_config[name]
  if default is None:
    raise ConfigError(f'the Flower run config has no {name!r}. Fix: flwr run ... --run-config \'{name}="..."\'.')
  return default


@app.main()
def main(grid: Grid, context: Context) -> None:
  """Runs the configured rounds over the connected SuperNodes and writes the run's outputs."""
  logging.set_verbosity(logging.WARNING)
  run_config = context.run_config
  use_compilation_cache(str(run_config_value(run_config, 'compilation-cache', DEFAULT_DIRECTORY)))
  cfg = deployed_config(config_from_flagfile(str(run_config_value(run_config, 'flagfile'))))
  cfg_json = json.dumps(cfg.to_dict())
  resume = bool(run_config_value(run_config, 'resume', False))
  round_timeout = float(run_config_value(run_config, 'round-timeout', 600.0))
  connect_timeout = float(run_config_value(run_config, 'connect-timeout', 120.0))

  summary = train_and_evaluate(cfg, str(run_config_value(run_config, 'workdir')), resume=resume, progress=False,
                               federation=lambda fed: FlowerRounds(fed, grid, cfg_json, round_timeout,
                                                                   connect_timeout))
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2), flush=True)

