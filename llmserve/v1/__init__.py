"""Generated from protos/llmserve/v1/*.proto by `llmserve gen-protos`. Do not edit."""
