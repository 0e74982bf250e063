"""Unit tests on tiny seeded models, one folder per subsystem as the packages are split.

The folders are packages so that test modules (and conftest files) in different folders may share a
name; pytest imports them as ``unit.<folder>.<module>``."""
