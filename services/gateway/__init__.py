"""The gateway: OpenAI-compatible HTTP API (aiohttp on uvloop) in front of the scheduler."""
