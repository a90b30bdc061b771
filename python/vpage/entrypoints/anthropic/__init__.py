"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
OpenAI-compatible chat pipeline: a request is translated into a chat completion request, and
the chat answer (whole, or its stream of chunks) into Anthropic's message and SSE events."""
