"""Configuration: the model's (from its config.json) and the engine's, frozen and validated."""
