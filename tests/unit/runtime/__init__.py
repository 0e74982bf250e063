"""rksc_engine.runtime: the scheduler, prefill, sampling, loading, cancellation and its soaks."""
