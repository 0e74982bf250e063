"""rksc_engine.kvcache: the radix prefix cache, shared-prefix attention, the suffix pool, ASKS and chunk reuse."""
