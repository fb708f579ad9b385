"""Serving load generator (``pdserve bench``): streams requests to any OpenAI-compatible
server and measures TTFT, ITL, TPOT, E2E, throughput and goodput.

Modules: ``workload`` (what to send: ``RequestSpec`` builders, exact-length prompts from
``prompts``), ``arrival`` (when), ``client`` (one timed streaming request), ``runner``
(``run_benchmark``), ``result`` (``RequestRecord``, ``BenchResult``), ``metrics``
(``summarize``), ``report`` (the table), ``plots`` (PNG figures), ``cli`` (the flags).
"""
