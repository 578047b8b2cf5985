"""The `llmserve` subcommands: each module registers one (or a few) with the CLI."""
