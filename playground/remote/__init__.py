"""Remote mode: the playground over any OpenAI-compatible server."""
