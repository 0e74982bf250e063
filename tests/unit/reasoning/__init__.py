"""rksc_engine.reasoning: self-consistency, CGEE, early stop, tree search and the votes."""
