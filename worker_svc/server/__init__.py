"""The worker's process edge: the gRPC server (app), the SglangScheduler servicer, health, proto
conversion, the TP leader and follower roles and their launch."""
