"""fedjax_het: model-heterogeneous federated learning in JAX/Flax."""
__version__ = '0.1.0'
