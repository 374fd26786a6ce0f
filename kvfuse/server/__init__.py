"""`kvfuse serve`: an OpenAI-compatible HTTP server (FastAPI) over one engine, with kvfuse's extensions."""
