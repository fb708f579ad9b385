"""``pdserve chaos`` / ``python -m bench.chaos``: a bounded run of greedy chat requests
against a stack it starts itself, while prefill transfers fail on purpose and workers and
Redis are killed; it reports what completed, migrated, failed cleanly or hung, whether the
KV pools and ``/dev/shm`` came back clean, and whether every stream's text equals the
engine's own greedy output (``report.acceptance``)."""
