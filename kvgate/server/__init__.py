"""The OpenAI-compatible HTTP server (FastAPI): ``kvgate serve``."""
