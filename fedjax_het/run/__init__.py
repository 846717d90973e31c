"""Running experiments: `config` (the run's settings), `registry` (method names to factories), `cli` (flags),
`experiment` (train_and_evaluate with checkpoints, logs and plots), `compare` and `tradeoff` (sweeps), and what a
run needs around the engine: `checkpoints`, `workdir`, `tensorboard`, `plots`, `interrupts`, `distributed`,
`launch`, `compilation_cache`."""
