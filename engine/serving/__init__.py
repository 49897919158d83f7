"""Serving the engine: EngineService (engine thread, streams) and the OpenAI-compatible server."""
