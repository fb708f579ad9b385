"""Prometheus metrics of the worker services (vLLM-style names, ``pdserve:`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

TTFT = Histogram(
    "pdserve:time_to_first_token_seconds", "Time from arrival to the first token.",
    ["role"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
ITL = Histogram(
    "pdserve:inter_token_latency_seconds", "Time between consecutive tokens of a request.",
    ["role"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
E2E = Histogram(
    "pdserve:e2e_request_latency_seconds", "Time from arrival to the last token.",
    ["role"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
QUEUE_TIME = Histogram(
    "pdserve:request_queue_time_seconds", "Time a request waited before its prefill ran.",
    ["role"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
RUNNING = Gauge("pdserve:num_requests_running", "Requests in the running batch.", ["role"])
WAITING = Gauge("pdserve:num_requests_waiting", "Requests queued for admission.", ["role"])
PROMPT_TOKENS_WAITING = Gauge(
    "pdserve:num_prompt_tokens_waiting",
    "Prompt tokens accepted and not computed yet (queued prefills, cached prefixes excluded).",
    ["role"],
)
KV_USAGE = Gauge("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", ["role"])
KV_FREE = Gauge(
    "pdserve:kv_free_blocks", "KV blocks allocatable now (cached ones included).", ["role"]
)
REQUESTS = Counter(
    "pdserve:request_success_total", "Finished requests by finish reason.", ["role", "reason"]
)
ERRORS = Counter(
    "pdserve:request_errors_total", "Requests that ended with an error.", ["role", "code"]
)
TRANSFER_BYTES = Counter(
    "pdserve:kv_transfer_bytes_total", "KV bytes moved between workers.", ["role", "transport"]
)
LOCAL_PREFILL_REROUTES = Counter(
    "pdserve:local_prefill_reroutes_total",
    "Requests the scheduler placed for a local prefill that this decode worker sent to a "
    "prefill worker instead: more than the limit was uncached where it landed (its cache and "
    "its KV store held less than the scheduler's index said).",
    ["role"],
)
PROMPT_TOKENS_CACHED = Counter(
    "pdserve:prompt_tokens_cached_total",
    "Prompt tokens whose KV this worker already held (its prefix cache): a prefill worker's "
    "admitted prompt's hit, a decode worker's reserve hit for a remote prefill, a local "
    "prefill's hit.",
    ["role"],
)
PROMPT_TOKENS_COMPUTED = Counter(
    "pdserve:prompt_tokens_computed_total",
    "Prompt tokens this worker's forward passes computed (a remote prefill's count on the "
    "prefill worker, none on the decode worker).",
    ["role"],
)
TRANSFER_SECONDS = Histogram(
    "pdserve:kv_transfer_seconds", "Per-request KV transfer time (first write to confirmed).",
    ["role", "transport"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
KV_OVERLAP = Histogram(
    "pdserve:kv_transfer_overlap_ratio",
    "Share of a request's KV bytes already delivered to the decode worker when its prefill "
    "computed the last layer (layer-wise overlap; tcp counts bytes handed to the socket).",
    ["role", "transport"], buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
)  # fmt: skip
KV_FENCES = Counter(
    "pdserve:kv_fences_total",
    "Reserved KV blocks set aside after a prefill that did not deliver, by how they were "
    "freed: confirmed (the writer said it stopped) or lease (its deadline plus grace passed).",
    ["role", "how"],
)
ENGINE_STEP_SECONDS = Histogram(
    "pdserve:engine_step_seconds",
    "Duration of one unit of engine work: a continuous-batching step (kind=step) or a batch "
    "of prefill-only prompts (kind=prefill).",
    ["role", "kind"], buckets=_LATENCY_BUCKETS,
)  # fmt: skip
STEP_BATCH = Histogram(
    "pdserve:engine_step_batch_size",
    "Sequences that got a token from one continuous-batching step.",
    ["role"], buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256),
)  # fmt: skip
ITL_TARGET = Gauge(
    "pdserve:itl_target_seconds",
    "The decode step time the running batch is kept within (--itl-target-ms; 0: no target, "
    "throughput mode).",
    ["role"],
)
BATCH_TARGET_USAGE = Gauge(
    "pdserve:batch_target_usage_perc",
    "Sequences on this worker (running, reserved and waiting) per sequence of its batch "
    "target (pdserve:target_batch_size): above 1, sequences wait for the ITL target. What a "
    "decode autoscaler scales on.",
    ["role"],
)
TARGET_BATCH = Gauge(
    "pdserve:target_batch_size",
    "Sequences the running batch (reservations included) takes now: the largest batch whose "
    "predicted decode step fits the ITL target, at most max_num_seqs. More wait or are "
    "refused.",
    ["role"],
)
DELIVERY_WAIT_TIMEOUTS = Counter(
    "pdserve:engine_delivery_wait_timeouts_total",
    "Steps after which the engine stopped waiting for the event loop to send their tokens.",
    ["role"],
)
