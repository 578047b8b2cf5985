# The two commands of the README quickstart.
#   make run   set everything up, fetch the default model (SmolLM2-135M-Instruct, once), start the
#              local cluster (tokenizer, worker, router), stream a chat answer through the router;
#              serves until Ctrl-C
#   make test  set everything up and run the default test suite
# Also: make demo (the same, exiting after the answer), make check-model (HF oracle check).
# MODEL=smollm2 (default) is the real model from the package index; MODEL=tiny|small|bench is a
# generated random-weight Llama (offline, gibberish text, every number checked against HF).
VENV := .venv/bin
MODEL ?= smollm2
REAL_MODEL_DIR := .models/smollm2-135m-instruct
ifeq ($(MODEL),smollm2)
MODEL_DIR := $(REAL_MODEL_DIR)
else
MODEL_DIR := .models/$(MODEL)
endif

DEMO_CHAT := What is the capital of France?
DEMO_FLAGS := --demo-chat "$(DEMO_CHAT)" --demo-max-new-tokens 64

.PHONY: setup run demo check-model test test-slow lint model real-model

setup:
	scripts/bootstrap.sh

# fetch-model reuses a folder that already holds the model, so this costs nothing the second time.
real-model: setup
	$(VENV)/llmserve fetch-model smollm2-135m-instruct --out $(REAL_MODEL_DIR)

ifeq ($(MODEL),smollm2)
model: real-model
else
model: setup
	test -f $(MODEL_DIR)/config.json || $(VENV)/llmserve make-model --arch llama --preset $(MODEL) --out $(MODEL_DIR)
endif

run: model
	$(VENV)/llmserve serve --model $(MODEL_DIR) $(DEMO_FLAGS)

demo: model
	$(VENV)/llmserve serve --model $(MODEL_DIR) $(DEMO_FLAGS) --exit-after-demo

check-model: model
	$(VENV)/llmserve bench-one-batch --model $(MODEL_DIR) --correct --dtype float32 --output-len 32

# The default suite runs the HF oracle and a router chat on the real model: fetch it first.
test: real-model lint
	LLMSERVE_REAL_MODEL=$(CURDIR)/$(REAL_MODEL_DIR) $(VENV)/python -m pytest -q -p no:cacheprovider

# ruff (pyproject.toml [tool.ruff]) and mypy over worker_svc, router, tokenizer_svc, llmserve ([tool.mypy]).
lint: setup
	$(VENV)/ruff check .
	$(VENV)/mypy

test-slow: real-model
	LLMSERVE_REAL_MODEL=$(CURDIR)/$(REAL_MODEL_DIR) $(VENV)/python -m pytest -q -m slow
