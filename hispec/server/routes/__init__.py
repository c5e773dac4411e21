"""The API's routes, one router per job: ``completions``, ``chat`` (chat completions), ``models``
(models and health) and ``metrics`` (Prometheus text)."""
