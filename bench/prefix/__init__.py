"""``python -m bench.prefix``: prefix reuse under three routing policies, side by side.

For each policy (round-robin, least-loaded, cache-aware) a fresh ``pdserve up --prefill 2
--decode 2 --routing <policy>`` stack, so every policy starts with cold caches; on it the
multi-turn and shared-prefix conversations of ``pdserve bench``; the workers' prefix-cache
and KV-transfer counters read before and after each. Then the targets, a markdown report, a
plot and the JSON of every request.

Modules: ``config`` (``PrefixConfig``, the flags' dataclass), ``stack`` (the ``pdserve up``
command line of a policy, and a started stack), ``workers`` (the workers' counters),
``targets`` (figures of a run and the pass/fail targets, pure), ``report`` (markdown, pure),
``plots``, ``runner`` (one whole run), ``cli``.
"""
