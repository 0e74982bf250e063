"""rksc_cli: ``rksc ask``."""
