# The two commands of the README quickstart.
#   make run   set everything up, build the default model, run it (checked against HF transformers)
#   make test  set everything up and run the default test suite
VENV := .venv/bin
DEFAULT_MODEL := .models/default

.PHONY: setup run test test-slow model

setup:
	scripts/bootstrap.sh

$(DEFAULT_MODEL)/config.json: | setup
	$(VENV)/llmserve make-model --arch llama --preset small --out $(DEFAULT_MODEL)

model: $(DEFAULT_MODEL)/config.json

run: setup model
	$(VENV)/llmserve bench-one-batch --model $(DEFAULT_MODEL) --correct --dtype float32 --output-len 32

test: setup
	$(VENV)/python -m pytest -q -p no:cacheprovider

test-slow: setup
	$(VENV)/python -m pytest -q -m slow
