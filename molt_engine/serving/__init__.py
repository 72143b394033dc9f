"""Serving: the loopback OpenAI-compatible server agents call, and the Agent contract. The engine's only HTTP."""
