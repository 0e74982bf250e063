"""The engine facade and its contract: exactness against transformers, bad input, the protocols, the model families."""
