"""Tooling of the synthetic demo checkpoint (`services/model/demo_checkpoint`): its needle
language, its training and its evaluation, and the model-free policy demo. Nothing in the
runtime or the services imports this package; the import-graph test enforces it."""
