"""``hispec serve``: an OpenAI-compatible HTTP server over the batched engine.

- ``async_engine``: runs the (single-threaded) ``Engine`` in one background thread and hands
  each request's committed text to its own asyncio queue;
- ``protocol``: parsing and validation of OpenAI request bodies, OpenAI-style errors;
- ``metrics``: counters, gauges and histograms in the Prometheus text format;
- ``app``: the FastAPI application (``create_app``);
- ``commands``: the ``hispec serve`` and ``hispec loadtest`` sub-commands;
- ``loadtest``: N concurrent streaming clients against a running server.

Importing this package needs nothing beyond hispec itself; the server modules need the
``server`` extra (``pip install 'hispec[server]'``: fastapi, uvicorn, httpx).
"""
