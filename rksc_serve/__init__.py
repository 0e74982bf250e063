"""rksc_serve: ``rksc serve``, an OpenAI-compatible HTTP server over one ``RKSCEngine``.

Every request goes through the engine's public request API (``engine.submit``), so concurrent
clients share the scheduler's decode batches and the radix prefix cache. The engine knows nothing
of HTTP; this package sits above it, beside ``rksc_integrations``.

``rksc_serve.app.create_app(engine, ...)`` builds the FastAPI app (tests run it in-process);
``rksc_serve.cli`` is the ``rksc serve`` subcommand. FastAPI, uvicorn and prometheus-client come
with the ``serve`` extra (``pip install 'rksc[serve]'``) and are imported only when a server is
built, so the ``rksc`` command works without them.
"""
