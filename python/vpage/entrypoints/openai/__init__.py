"""OpenAI-compatible HTTP server (`vpage serve`)."""
