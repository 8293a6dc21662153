"""The OpenAI-compatible HTTP server: protocol models, request handlers, the FastAPI app, metrics."""
