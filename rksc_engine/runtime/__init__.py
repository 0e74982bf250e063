"""The runtime: runs requests from submit to retire (the scheduler's step loop, the model runner's
forward passes, prefill through the radix cache, sampling, model loading). Never imports the engine
facade, reasoning, structured output or any integration."""
