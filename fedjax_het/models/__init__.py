"""Flax classifiers `extractor -> RM -> head` and the architecture registry."""
from fedjax_het.models.classifier import RM_MODES, HeteroClassifier
from fedjax_het.models.pooling import adaptive_avg_pool1d, adaptive_bins, adaptive_max_pool1d
from fedjax_het.models.registry import assign_models, build_model, model_names, register_model
