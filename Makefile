# The two commands of the README quickstart.
#   make run   set everything up, build the default model, start the local cluster (tokenizer,
#              worker, router) and stream a generation through the router; serves until Ctrl-C
#   make test  set everything up and run the default test suite
# Also: make demo (the same, exiting after the generation), make check-model (HF oracle check).
VENV := .venv/bin
DEFAULT_MODEL := .models/default

.PHONY: setup run demo check-model test test-slow model

setup:
	scripts/bootstrap.sh

$(DEFAULT_MODEL)/config.json: | setup
	$(VENV)/llmserve make-model --arch llama --preset small --out $(DEFAULT_MODEL)

model: $(DEFAULT_MODEL)/config.json

DEMO_PROMPT := The capital of France is

run: setup model
	$(VENV)/llmserve serve --model $(DEFAULT_MODEL) --demo-prompt "$(DEMO_PROMPT)"

demo: setup model
	$(VENV)/llmserve serve --model $(DEFAULT_MODEL) --demo-prompt "$(DEMO_PROMPT)" --exit-after-demo

check-model: setup model
	$(VENV)/llmserve bench-one-batch --model $(DEFAULT_MODEL) --correct --dtype float32 --output-len 32

test: setup
	$(VENV)/python -m pytest -q -p no:cacheprovider

test-slow: setup
	$(VENV)/python -m pytest -q -m slow
