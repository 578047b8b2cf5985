"""Requests, the scheduler and the engine loop that drives steps."""
