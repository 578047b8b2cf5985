"""Running the model: build and load it, quantize it, size the KV cache, run one step."""
