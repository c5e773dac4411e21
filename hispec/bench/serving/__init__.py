"""``hispec bench serve`` and ``hispec bench soak``: an OpenAI-compatible server measured as users measure
servers (vLLM's ``vllm bench serve``), and a long mixed load that checks it loses nothing.

- ``datasets.py``  the requests: Spec-Bench, ShareGPT multi-turn, synthetic shared prefixes, random lengths
- ``metrics.py``   per-request outcomes -> TTFT / TPOT / ITL / E2E percentiles, throughput, goodput;
                   Poisson (gamma) arrival times
- ``client.py``    the streaming client: one request's timings, a run at a request rate and concurrency
- ``servers.py``   the servers the command starts on loopback (hispec, llama.cpp's llama-server,
                   vLLM's ``vllm serve``) and stops, also on Ctrl-C
- ``commands.py``  ``hispec bench serve``: options, the sweep, the printed table, the result file
- ``plots.py``     the sweep's plot
- ``soak.py``      ``hispec bench soak``: concurrency 16 for a duration, disconnects, a SIGTERM drain;
                   errors, lost requests, RSS growth, KV blocks leaked

Only the standard library and hispec are imported at registration: httpx (the ``server`` extra),
numpy, transformers and matplotlib when a command runs.
"""
