"""The worker's process edge: the SglangScheduler servicer, proto conversion, TP leader/follower roles."""
