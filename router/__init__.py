"""The router: the public `llmserve.v1.Router` service in front of the tokenizer service and the
worker groups (see router/README.md). Light to import: no torch anywhere in this package."""
