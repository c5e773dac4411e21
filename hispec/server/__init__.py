"""``hispec serve``: an OpenAI-compatible HTTP server over the batched engine.

- ``app``: the FastAPI application (``create_app``): the routers over one ``ServerState``;
- ``routes``: one router per job: ``completions``, ``chat``, ``models`` (and health), ``metrics``;
- ``generation``: one request from parsed body to JSON answer or server-sent events;
- ``schema``: the request bodies as pydantic models, which validate them and document them
  (``openapi``); ``deps``: reading, checking and parsing a body, the API key;
- ``state``: the served model, tokenizer and limits, and a parsed request made engine work;
- ``errors``: OpenAI-style errors; ``responses``: choices, usage and log-probabilities; ``tools``:
  function calling;
- ``async_engine``: runs the (single-threaded) ``Engine`` in one background thread and hands
  each request's committed text to its own asyncio queue;
- ``metrics`` and ``vllm_metrics``: counters, gauges and histograms (hispec's names and vLLM's),
  written by ``prometheus``;
- ``commands``: the ``hispec serve`` and ``hispec loadtest`` sub-commands;
- ``loadtest``: N concurrent streaming clients against a running server.

Importing this package needs nothing beyond hispec itself; the server modules need the
``server`` extra (``pip install 'hispec[server]'``: fastapi, uvicorn, httpx).
"""
