"""The engine core (vLLM's EngineCore, Scheduler and KV cache manager): the step loop
(``_engine_core``), the token-budget ``Scheduler``, the ``Request`` record and the paged KV cache's
block pool, prefix hashing and manager (``kv/``). No torch is imported here."""
