"""A Flower deployment of any registered method: the same client programs and server steps as a simulation, one
client per Flower SuperNode (`flwr` 1.42, Message API; `pip install 'fedjax_het[flower]'`).

  records.py     pytrees <-> Flower ArrayRecords
  node.py        one client on its node: its partition, its state between rounds, its program's round and score
  rounds.py      the server's rounds over a Flower Grid, in place of the simulation's executor
  server_app.py  the ServerApp: a run's flags, workdir, metrics and checkpoints, as experiments/ writes them
  client_app.py  the ClientApp: query (which client a node holds), train, evaluate
  run_config.py  the run config's keys: the deployment's, and one per experiment flag (rounds=2, num-clients=4)
  local.py       a SuperLink and N SuperNodes on this machine, and the run (python -m fedjax_het.flower.local)
"""

