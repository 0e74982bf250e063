"""KV caching: the radix prefix cache under the RSBCM budget, the batched shared-prefix attention,
ASKS and retrieved-chunk KV reuse, and out-of-memory roll-back. Imports nothing above it."""
