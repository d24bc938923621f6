"""The builtin inference engine: token generation and its OpenAI-compatible HTTP server."""
