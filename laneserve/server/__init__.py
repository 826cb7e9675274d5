"""The serving system's HTTP side: OpenAI-compatible API (:mod:`.api`), request
validation (:mod:`.protocol`), incremental detokenisation (:mod:`.detok`) and Prometheus
metrics (:mod:`.metrics`). The router and instance processes live in :mod:`laneserve.cluster`."""
