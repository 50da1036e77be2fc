"""Caches above the engine (the KV prefix cache lives in fivefold/engine)."""
