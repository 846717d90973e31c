"""What several methods share: `base`, a loss turned into a client program and evaluation by heads; `common`, the
losses, prototypes and optimiser loops; `global_model`, a small global model trained beside each client's (FML,
FedKD, FedMRL, pFedAFM, FedType); `public`, the server's public rows (FedMD, FedDF); `finch`, FINCH clustering
(FPL)."""
