"""Where users come in: the offline `LLM`, the CLI, and (elsewhere) the OpenAI-compatible server."""
