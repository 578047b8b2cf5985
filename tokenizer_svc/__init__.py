"""The tokenizer service: encode / chat-encode / decode / streaming detokenization over gRPC."""
