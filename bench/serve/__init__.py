"""Serving load generator (``pdserve bench``): streams requests to any OpenAI-compatible
server and measures TTFT, ITL, TPOT, E2E, throughput and goodput.

Modules: ``workload`` (what to send: ``RequestSpec`` builders, exact-length prompts from
``prompts``), ``sessions`` (conversations: multi-turn, shared system prompts), ``arrival``
(when), ``client`` (one timed streaming request), ``runner`` (``run_benchmark``),
``session_runner`` (``run_sessions``: turns in order, sessions side by side), ``result``
(``RequestRecord``, ``BenchResult``), ``metrics`` (``summarize``), ``reuse`` (cached vs
computed tokens, KV bytes, per worker), ``report`` (the table), ``plots`` (PNG figures),
``cli`` (the flags). Trace replay: ``trace`` (Mooncake's JSONL format), ``trace_replay``
(a trace as ``RequestSpec`` lists, fitted to the host), ``trace_gen`` (synthetic traces).
"""
