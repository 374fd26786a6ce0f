"""kvfuse: answer questions over knowledge with a local LLM and almost no prefill."""

__version__ = "0.1.0"
