"""Tensor-parallel communication primitives: the TP context, process groups, heartbeat, step broadcast."""
