"""rksc_serve (the OpenAI-compatible server, its cluster) and RemoteEngine, its client."""
