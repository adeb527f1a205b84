"""Hosts over the core: the offline `Engine`, the continuous-batching `Scheduler` with its adaptive
`Controller`, request bookkeeping, and the OpenAI-compatible HTTP server (`serving.server`)."""
