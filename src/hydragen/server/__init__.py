"""OpenAI-compatible HTTP server over the step-driven engine."""
