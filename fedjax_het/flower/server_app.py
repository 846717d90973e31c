"""The ServerApp: a fedjax_het run whose clients are Flower SuperNodes, with the outputs of a simulation run
(metrics.jsonl, summary.json, plots, orbax checkpoints and --resume) in its workdir.

Run config (flwr run ... --run-config '...'; experiments/flower/pyproject.toml lists the keys): flagfile (the run's
flags, as experiments/ takes them; absolute path on the SuperLink's machine), workdir (its outputs there), resume
(continue from its last checkpoint), round-timeout (seconds a round waits for its replies, default 600),
connect-timeout (seconds to wait for the nodes, default 120), run-name (the folder of the nodes' states; give each
run its own), node-ids (JSON {client: node id} of the SuperNode keys registered for the clients: no other node's
claim to a client is taken), upload-bound (the largest absolute value an upload may hold, default 1e6: a node's
upload beyond it, like one with NaN values or arrays of other shapes, is left out of its round), compilation-cache
(XLA's persistent compilation cache, default ~/.cache/fedjax_het/xla); and one key per experiment flag, its name
with - for _ (rounds=2, num-clients=4), which overrides the flag file's value as a flag given after --flagfile does
(`fedjax_het.flower.run_config`).
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from absl import flags, logging
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedjax_het.errors import ConfigError
from fedjax_het.flower.node import deployed_config
from fedjax_het.flower.rounds import UPLOAD_BOUND, FlowerRounds
from fedjax_het.flower.run_config import experiment_flag_values, override_arguments, run_name
from fedjax_het.run import cli
from fedjax_het.run.compilation_cache import DEFAULT_DIRECTORY, use_compilation_cache
from fedjax_het.run.experiment import train_and_evaluate

app = ServerApp()


def parse_experiment_flags(flagfile: str = '', overrides: Sequence[str] = ()) -> flags.FlagValues:
  """The experiment flags of `flagfile` ('': none) with the flag arguments `overrides` after it, parsed as the
  experiment entry points parse `--flagfile=FILE --rounds=2 ...` (a later flag wins); a ConfigError naming a bad
  flag or value."""
  fv = experiment_flag_values()
  cli.parse_flags(['flower'] + ([f'--flagfile={flagfile}'] if flagfile else []) + list(overrides), fv)
  return fv


def config_from_flagfile(path: str, overrides: Sequence[str] = ()):
  """The `ExperimentConfig` of a flag file and the flag arguments `overrides` after it, as the experiment entry
  points read them."""
  return cli.config_from_flags(parse_experiment_flags(path, overrides))


def experiment_flags(run_config: dict) -> flags.FlagValues:
  """The experiment flags of a Flower run config: its flagfile, then its experiment keys that are not ""."""
  return parse_experiment_flags(str(run_config.get('flagfile') or ''), override_arguments(run_config))


def run_config_value(run_config: dict, name: str, default: Optional[Any] = None) -> Any:
  """A value of the Flower run config, or `default`; a ConfigError naming it when it is required and missing."""
  if run_config.get(name) not in (None, ''):
    return run_config[name]
  if default is None:
    raise ConfigError(f'the Flower run config has no {name!r}. Fix: flwr run ... --run-config \'{name}="..."\'.')
  return default


def node_ids(run_config: dict) -> Optional[dict[int, int]]:
  """The run config's node-ids, {client: node id} of the SuperNode keys registered for the clients, or None."""
  text = run_config.get('node-ids') or ''
  if not text:
    return None
  try:
    return {int(k): int(v) for k, v in json.loads(text).items()}
  except (ValueError, TypeError, AttributeError):
    raise ConfigError(f'the run config\'s node-ids={text!r} is not a JSON object of client -> node id. Fix: '
                      f'node-ids=\'{{"0": NODE_ID, "1": NODE_ID, ...}}\' as flwr supernode register printed '
                      f'them.') from None


def _log(line: str) -> None:
  print(line, flush=True)  # streamed to `flwr run --stream` as it is written


@app.main()
def main(grid: Grid, context: Context) -> None:
  """Runs the configured rounds over the connected SuperNodes and writes the run's outputs."""
  logging.set_verbosity(logging.WARNING)
  run_config = context.run_config
  use_compilation_cache(str(run_config.get('compilation-cache', DEFAULT_DIRECTORY)))  # '': off, as the flag
  fv = experiment_flags(run_config)
  cfg = deployed_config(cli.config_from_flags(fv))
  cfg_json = json.dumps(cfg.to_dict())
  resume = bool(run_config_value(run_config, 'resume', False))
  round_timeout = float(run_config_value(run_config, 'round-timeout', 600.0))
  connect_timeout = float(run_config_value(run_config, 'connect-timeout', 120.0))
  upload_bound = float(run_config_value(run_config, 'upload-bound', UPLOAD_BOUND))
  registered = node_ids(run_config)
  run_name(run_config.get('run-name', 'default'))  # the nodes refuse a name that is no plain folder name: say so now

  workdir = str(run_config_value(run_config, 'workdir'))
  summary = train_and_evaluate(cfg, workdir, resume=resume, progress=False, say=_log,
                               tensorboard=fv.tensorboard,
                               federation=lambda fed: FlowerRounds(fed, grid, cfg_json, round_timeout,
                                                                   connect_timeout, log=_log,
                                                                   upload_bound=upload_bound,
                                                                   registered=registered, workdir=workdir,
                                                                   progress=_log))
  print(json.dumps({k: v for k, v in summary.items() if k != 'config'}, indent=2), flush=True)

