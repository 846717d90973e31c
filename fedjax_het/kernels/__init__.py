"""Hand-written kernels: `onednn`, oneDNN's convolutions called from XLA:CPU as a custom call (--conv=onednn),
compiled from `onednn_conv.cc` on first use."""
