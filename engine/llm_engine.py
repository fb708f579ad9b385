"""The colocated engine: one process runs prefill and decode with continuous batching.

This is the monolithic baseline every benchmark compares against, and the core the decode
and prefill workers build on. The loop is ``step()``: schedule -> forward -> sample ->
postprocess; callers add and abort requests between steps (one thread drives it).

The running batch (running sequences plus a decode worker's reservations) is capped by the
engine's ``StepBudget`` (``engine/step_budget.py``): the largest batch whose decode step
fits the ITL target (``EngineConfig.itl_target_ms``). ``calibrate`` times a few steps before
serving; every pure decode step ``step()`` runs refreshes the model.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.block_hash import hash_blocks
from engine.block_manager import BlockManager
from engine.cache_events import CacheEventLog
from engine.checkpoint import Checkpoint, load_checkpoint, model_digest
from engine.device import DTYPES
from engine.engine_config import EngineConfig
from engine.errors import CapacityError, InvalidRequestError, ResourceExhaustedError
from engine.grammar import Grammars
from engine.kv_cache import KVCache, KVCacheSpec
from engine.kv_staging import KVStaging, LayerReady, after_enqueued, ready_now
from engine.model import LlamaModel
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor, RequestOutput
from engine.sampler import skip_draws
from engine.sampling_params import SamplingParams
from engine.scheduler import BatchLimits, ScheduledSeq, Scheduler
from engine.sequence import FinishReason, Sequence
from engine.step_budget import StepBudget
from engine.step_calibration import time_decode_steps
from engine.tokenizer import Tokenizer
from engine.top_logprobs import TopLogprobs
from kernels.quant_linear import QuantizedWeight
from kernels.quant_linear import kernel_available as quant_kernel_available

log = structlog.get_logger(__name__)


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded request's own random stream, on the device its noise is drawn on (a seed
    gives the same tokens on every worker of one device type, not across CPU and CUDA)."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


@dataclass(frozen=True)
class AdmittedPrompt:
    """A prompt admitted for a prefill-only pass: its local blocks are allocated."""

    request_id: str
    block_ids: tuple[int, ...]  # every block of the prompt, cached prefix first
    num_tokens: int  # the prompt, plus a migrated request's resumed output tokens
    num_cached_tokens: int  # served from this worker's prefix cache


@dataclass(frozen=True)
class Reservation:
    """A decode worker's blocks for a prompt another worker prefills.

    ``block_ids`` covers every token (prompt, then a migrated request's resumed output), the
    cached prefix first. The first ``num_present_tokens`` tokens' KV is already in their
    blocks (this pool's prefix cache: earlier requests' prompts and outputs): a multiple of
    the block size, less than the token count; the prefill worker writes only the rest.
    """

    request_id: str
    block_ids: tuple[int, ...]
    num_present_tokens: int


@dataclass(frozen=True)
class PrefillOutput:
    request_id: str
    token_id: int  # the first generated token
    logprob: float
    block_ids: tuple[int, ...]  # still held: call ``release`` once the KV has been sent
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: TopLogprobs | None = None  # when the request asks for them


@dataclass
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0


def _weight_format(config: EngineConfig) -> str:
    """The format this engine loads: quantized needs the compiled kernel (and its
    ``cpu_kernels`` setting); without them the exact float32 path serves instead."""
    if config.weights != "quantized":
        return config.weights
    if config.cpu_kernels and quant_kernel_available():
        return "quantized"
    log.warning(
        "quantized_weights_unavailable",
        reason="cpu kernels off" if not config.cpu_kernels else "kernel did not build",
        serving="float32",
    )
    return "float32"


def _format_of(checkpoint: Checkpoint) -> str:
    packed = any(isinstance(t, QuantizedWeight) for t in checkpoint.tensors.values())
    return "quantized" if packed else "float32"


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        checkpoint: Checkpoint | None = None,
        tokenizer: Tokenizer | None = None,
        kv_memory: Callable[[KVCacheSpec], torch.Tensor] | None = None,
    ) -> None:
        """``config`` is resolved as the ``colocated`` role where it says ``auto``
        (``EngineConfig.resolved``); ``checkpoint``: weights already loaded (their format
        wins over ``config.weights``).

        ``kv_memory(spec)`` supplies host memory for the pool (e.g. a registered
        shared-memory region a prefill worker writes into); by default the engine allocates
        the pool. On a device other than the CPU (or with ``kv_staging``) that memory holds
        a host pool beside the device pool instead (``kv_host``; ``stage_layer`` and the
        upload in ``add_prefilled`` move blocks between them)."""
        self.config = config = config.resolved()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = torch.device(config.device)
        ckpt = self._load_model(checkpoint)
        self.tokenizer = tokenizer or Tokenizer.from_path(ckpt.path)
        self._make_kv_pool(kv_memory)
        # What the prefix cache gains and loses, for the worker to publish to the scheduler.
        self.cache_events = CacheEventLog()
        self.blocks = BlockManager(
            self.kv_spec.num_blocks,
            config.block_size,
            enable_prefix_caching=config.prefix_caching,
            events=self.cache_events,
        )
        self.scheduler = Scheduler(self._batch_limits(), self.blocks)
        self.runner = ModelRunner(self.model, self.kv, self.tokenizer.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.tokenizer.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, ckpt.config.vocab_size)
        self._ids = itertools.count()
        self.num_preemptions = 0
        # Until ``calibrate``, an automatic target is not known: the cap is max_num_seqs.
        self.step_budget = StepBudget(config.max_num_seqs, self._configured_target_s())
        # Sequences outside the scheduler: admitted prompts awaiting release, and decode
        # reservations awaiting their KV. Their blocks are allocated.
        self._held: dict[str, Sequence] = {}
        # ``kv_export(hashes, block_ids)``: told, on the engine thread, of full blocks whose
        # KV this engine computed (a KV store copies them out: ``kvstore``). Called after a
        # prefill-only pass (the prompt's blocks) and when a request finishes (the blocks
        # not yet told: its output's, in a decode worker). It returns the ids it will read
        # later: each is held (``BlockManager.hold``) until it calls ``free_blocks`` for
        # it. It must be quick (it copies nothing) and must not raise.
        self.kv_export: Callable[[Seq[int], Seq[int]], Seq[int] | None] | None = None

    def _load_model(self, checkpoint: Checkpoint | None) -> Checkpoint:
        """Load the checkpoint (unless given) and build the model on this engine's device;
        sets ``weight_format``, ``model_config``, ``model_digest``, ``model`` and
        ``max_model_len``. Returns the checkpoint."""
        config = self.config
        if checkpoint is None:
            self.weight_format = _weight_format(config)
            checkpoint = load_checkpoint(
                config.model,
                dtype=DTYPES[config.dtype],
                quantized=self.weight_format == "quantized",
            )
        else:
            self.weight_format = _format_of(checkpoint)
        self.model_config = checkpoint.config
        self.model_digest = model_digest(checkpoint)
        self.model = LlamaModel(
            checkpoint.config,
            checkpoint.tensors,
            cpu_kernels=config.cpu_kernels,
            device=self.device,
            triton_kernels=config.uses_triton,
            batch_invariant=config.batch_invariant,
        )
        context = checkpoint.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or context, context)
        return checkpoint

    def _make_kv_pool(self, kv_memory: Callable[[KVCacheSpec], torch.Tensor] | None) -> None:
        """Size the KV pool and allocate it (or place it in ``kv_memory``'s); sets
        ``kv_spec``, ``kv``, ``staging`` and ``kv_host``."""
        config = self.config
        kv_dtype = DTYPES[config.kv_cache_dtype]
        num_blocks = config.num_kv_blocks or KVCacheSpec.blocks_for_bytes(
            self.model_config,
            config.kv_cache_mib << 20,
            block_size=config.block_size,
            dtype=kv_dtype,
        )
        if num_blocks < 1:
            raise CapacityError("the KV cache budget is smaller than one block")
        self.kv_spec = KVCacheSpec.for_model(
            self.model_config, num_blocks=num_blocks, block_size=config.block_size, dtype=kv_dtype
        )
        memory = kv_memory(self.kv_spec) if kv_memory else None
        self.staging: KVStaging | None = None
        staged = self.device.type != "cpu" or config.kv_staging
        if memory is not None and memory.device.type == "cpu" and staged:
            self.kv = KVCache(self.kv_spec, device=self.device)
            self.staging = KVStaging(self.kv, KVCache(self.kv_spec, memory))
        else:
            self.kv = KVCache(self.kv_spec, memory, device=self.device)
        # The pool transports read and write: the host pool when staged, else the pool.
        self.kv_host = self.staging.host_kv if self.staging else self.kv

    def _batch_limits(self) -> BatchLimits:
        """What one step may hold: chunked prefill's chunk, else the configured budget or a
        whole context."""
        config = self.config
        return BatchLimits(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=(
                config.chunked_prefill or config.max_num_batched_tokens or self.max_model_len
            ),
            chunked_prefill=config.chunked_prefill > 0,
        )

    def _configured_target_s(self) -> float | None:
        """The ITL target the config sets (None: none, or the automatic one)."""
        ms = self.config.itl_target_ms
        return ms / 1000 if ms else None

    # -- the running batch's cap -------------------------------------------------------
    @property
    def batch_cap(self) -> int:
        """Sequences the running batch (reservations included) may hold now."""
        return self.step_budget.cap

    @property
    def itl_target_s(self) -> float:
        """The ITL target the cap keeps to, in seconds; 0: none (throughput mode)."""
        return self.step_budget.target_s or 0.0

    def calibrate(self) -> StepBudget:
        """Time decode steps at batch 1 and a larger batch on dummy sequences
        (``engine/step_calibration.py``: under a second, every block given back) and start
        the step-time model from them; the automatic ITL target becomes a multiple of the
        batch-1 step. A no-op in throughput mode (``itl_target_ms`` 0). Needs an idle
        engine (``RuntimeError``); returns the budget."""
        if self.config.itl_target_ms == 0:
            return self.step_budget
        if self.has_unfinished() or self._held:
            raise RuntimeError("calibrate needs an idle engine")
        samples = time_decode_steps(self.runner, self.blocks, self.config.max_num_seqs)
        self.step_budget = StepBudget.calibrated(
            samples, max_num_seqs=self.config.max_num_seqs, target_s=self._configured_target_s()
        )
        return self.step_budget

    @classmethod
    def from_path(cls, model: str | Path | None = None, **kwargs: object) -> LLMEngine:
        return cls(EngineConfig(model=None if model is None else str(model), **kwargs))  # type: ignore[arg-type]

    # -- requests --------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token {i} is {t!r}: token ids must be integers in [0, {vocab})"
                )
        return ids

    def _validate(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams,
        *,
        generates_here: bool,
        resumed: Seq[int] = (),
    ) -> list[int]:
        """Every request's checks; ``generates_here``: the output's KV must fit this pool too
        (not so for a prefill-only pass); ``resumed``: output tokens a migrated request
        already produced elsewhere. Returns the prompt ids."""
        ids = self.encode_prompt(prompt)
        if resumed:
            if len(resumed) >= params.max_tokens:
                raise InvalidRequestError(
                    f"resume_token_ids has {len(resumed)} tokens; max_tokens is "
                    f"{params.max_tokens}: there is nothing to resume"
                )
            self.encode_prompt(list(resumed))  # the same id checks as a prompt's
            self.outputs.check_resumable(params, resumed)
        params.check_against(
            prompt_len=len(ids),
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
        )
        if generates_here:
            needed = self.blocks.blocks_needed(len(ids) + params.max_tokens)
            if needed > self.blocks.num_blocks:
                raise CapacityError(
                    f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) needs {needed} KV "
                    f"blocks; the cache has {self.blocks.num_blocks}"
                )
        if self.scheduler.get(request_id) is not None or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        return ids

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        resumed: Seq[int] = (),
    ) -> str:
        """Validate and queue a request; returns its id. Raises InvalidRequestError.

        ``resumed``: a migrated request's output tokens so far; prompt + those are computed
        and generation continues after them (see ``_sequence``)."""
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        ids = self._validate(rid, prompt, params, generates_here=True, resumed=resumed)
        seq = self._sequence(rid, ids, params, resumed)
        self.scheduler.add(seq)
        self.outputs.add(rid, params, resumed)
        return rid

    def _sequence(
        self, request_id: str, ids: list[int], params: SamplingParams, resumed: Seq[int]
    ) -> Sequence:
        """A fresh sequence. A resumed one starts with its output tokens already in place
        (context to compute, counted against max_tokens) and its seeded random stream
        advanced past them, so it samples what an uninterrupted run would have; its
        structured output's matcher is advanced past them too. Raises InvalidRequestError
        for a structured output that does not compile or that ``resumed`` breaks."""
        generator = _generator(params, self.device)
        seq = Sequence(request_id, ids, params, time.monotonic(), generator=generator)
        if params.structured is not None:
            seq.grammar = self.grammars.matcher(params.structured, resumed)
        if resumed:
            seq.output_ids = list(resumed)
            seq.output_logprobs = [float("nan")] * len(resumed)  # not known here, not re-sent
            if seq.generator is not None and not params.greedy:
                skip_draws(seq.generator, self.model_config.vocab_size, len(resumed))
        return seq

    # -- disaggregated roles -----------------------------------------------------------
    # A prefill worker calls admit_prompt -> run_prefill (in one pass, or chunk by chunk)
    # -> (send KV) -> release.
    # A decode worker calls reserve (its own cached prefix reused) -> (prefill worker fills
    # the other blocks) -> add_prefilled, or release if the prefill failed.
    # Both run on the engine's one thread.

    def _claim_blocks(self, seq: Sequence) -> None:
        """Give a fresh sequence the cached blocks of its longest cached prefix and allocate
        the rest. On failure nothing stays claimed: CapacityError when the rest can never
        fit the pool, ResourceExhaustedError when it does not fit now."""
        hit = self.scheduler.match_prefix(seq)
        need = self.blocks.blocks_needed(seq.num_tokens) - len(seq.block_table)
        try:
            if need > self.blocks.num_blocks:
                raise CapacityError(
                    f"prompt needs {need} KV blocks; the cache has {self.blocks.num_blocks}"
                )
            seq.block_table.extend(self.blocks.allocate(need))
        except Exception:
            self.scheduler.undo_hit(seq, hit)
            raise

    def admit_prompt(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        resumed: Seq[int] = (),
    ) -> AdmittedPrompt:
        """Validate a prompt and allocate its blocks (reusing cached prefix blocks).

        ``resumed``: a migrated request's output tokens so far, computed after the prompt;
        the sampled token is then the next output token. Raises InvalidRequestError,
        CapacityError, or ResourceExhaustedError when the pool is full right now. The blocks
        stay held until ``release``.
        """
        ids = self._validate(
            request_id, list(prompt_ids), params, generates_here=False, resumed=resumed
        )
        seq = self._sequence(request_id, ids, params, resumed)
        self._claim_blocks(seq)
        self._held[request_id] = seq
        return AdmittedPrompt(
            request_id, tuple(seq.block_table), seq.num_tokens, seq.num_cached_tokens
        )

    def run_prefill(
        self,
        prompts: Seq[AdmittedPrompt],
        on_layer_kv: Callable[[int], None] | None = None,
        *,
        max_tokens: Seq[int] | None = None,
    ) -> list[PrefillOutput]:
        """Compute planned prompts in one forward pass and sample the first token of each
        prompt the pass completes; outputs in ``prompts`` order, only for those.

        ``max_tokens[i]``: compute at most that many of ``prompts[i]``'s tokens not computed
        yet (a chunk; default: all of them). A prompt left unfinished is continued by a
        later call (``prefill_pending``). ``on_layer_kv(i)`` fires when layer ``i``'s KV of
        this pass is in the pool.
        """
        seqs = [self._held[p.request_id] for p in prompts]
        limits = max_tokens if max_tokens is not None else [seq.pending for seq in seqs]
        items = [
            ScheduledSeq(seq, min(seq.pending, n)) for seq, n in zip(seqs, limits, strict=True)
        ]
        if any(it.num_tokens < 1 for it in items):
            raise ValueError("every prompt of a prefill pass computes at least one token")
        sampled = {s.item.seq.request_id: s for s in self.runner.execute(items, on_layer_kv)}
        outs = []
        for it in items:
            self.scheduler.advance(it)
            seq = it.seq
            self._export(seq)
            tok = sampled.get(seq.request_id)
            if tok is None:
                continue  # a chunk: the prompt goes on in a later pass
            outs.append(
                PrefillOutput(
                    seq.request_id,
                    tok.token_id,
                    tok.logprob,
                    tuple(seq.block_table),
                    len(seq.prompt_ids),
                    seq.num_cached_tokens,
                    tok.top,
                )
            )
        return outs

    def prefill_pending(self, request_id: str) -> int:
        """Tokens of a held admitted prompt not computed yet (0 once ``run_prefill`` completed
        it, or for an id not held)."""
        seq = self._held.get(request_id)
        return 0 if seq is None else seq.pending

    def _export(self, seq: Sequence) -> None:
        """Tell ``kv_export`` of ``seq``'s full blocks it has not been told of."""
        done = seq.num_exported_blocks
        if self.kv_export is None or len(seq.block_hashes) <= done:
            return
        n = len(seq.block_hashes)
        held = self.kv_export(seq.block_hashes[done:n], seq.block_table[done:n])
        if held:
            self.blocks.hold(held)
        seq.num_exported_blocks = n

    # -- loading a prefix computed elsewhere (a KV store) ------------------------------
    # prefix_hashes -> claim_blocks -> (the loader fills them, off this thread) ->
    # commit_loaded -> (admit_prompt / add_request / reserve find them as a prefix hit)
    # -> free_blocks. All on the engine thread but the filling.

    def prefix_hashes(self, token_ids: Seq[int]) -> tuple[int, list[int]]:
        """The chained hashes of the full blocks a request on ``token_ids`` could reuse
        (never its last token's), and how many leading ones this pool caches now."""
        hashes = hash_blocks(list(token_ids[: len(token_ids) - 1]), self.kv_spec.block_size)
        return self.blocks.cached_prefix_length(hashes), hashes

    def claim_blocks(self, n: int) -> tuple[int, ...]:
        """``n`` free blocks, held until ``free_blocks``, for a loader to fill;
        ``ResourceExhaustedError`` (nothing held) when fewer are free."""
        return tuple(self.blocks.allocate(n))

    def commit_loaded(self, block_ids: Seq[int], block_hashes: Seq[int]) -> None:
        """Blocks a loader filled with the KV ``block_hashes`` name (a leading run of one
        prompt's chain) enter the prefix cache; they stay held until ``free_blocks``."""
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            self.blocks.commit_full_block(block_id, block_hash)

    def free_blocks(self, block_ids: Seq[int]) -> None:
        """Drop the hold ``claim_blocks`` took (committed blocks stay cached)."""
        self.blocks.free(block_ids)

    def stage_layer(self, layer: int, block_ids: Seq[int]) -> LayerReady:
        """Engine thread, inside ``run_prefill``'s ``on_layer_kv(layer)``: start copying
        ``layer``'s KV of ``block_ids`` into ``kv_host``; the result says when a reader of
        ``kv_host`` may read it (at once when the pool is ``kv_host``)."""
        if self.staging is None:
            return ready_now
        return self.staging.stage_layer(layer, block_ids)

    def layer_written(self, layer: int) -> LayerReady:
        """Engine thread, inside ``run_prefill``'s ``on_layer_kv(layer)``: when a reader of
        the device pool itself (``cuda_ipc``) may read ``layer``'s KV: after what the
        compute stream has enqueued so far (at once on the CPU)."""
        return after_enqueued(self.device)

    def release(self, request_id: str) -> bool:
        """Free a admitted prompt's blocks (they stay in the prefix cache) or a reservation."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.release(seq)
        return True

    def reserve(
        self,
        request_id: str,
        prompt_ids: Seq[int],
        params: SamplingParams,
        resumed: Seq[int] = (),
    ) -> Reservation:
        """Validate and allocate blocks for a prompt (plus a migrated request's ``resumed``
        output tokens) another worker will prefill, reusing this pool's cached blocks of its
        longest cached full-block prefix (never its last token). The blocks stay held until
        ``add_prefilled`` or ``release`` (also under a ``fence`` key).
        Raises InvalidRequestError, CapacityError, or ResourceExhaustedError when the batch
        (``batch_cap``: its ITL target's, at most max_num_seqs) or the pool is full now;
        nothing stays held then."""
        ids = self._validate(
            request_id, list(prompt_ids), params, generates_here=True, resumed=resumed
        )
        cap = self.batch_cap
        if len(self.scheduler.running) + len(self._held) >= cap:
            why = "its ITL target's" if cap < self.config.max_num_seqs else "max_num_seqs"
            raise ResourceExhaustedError(f"decode batch is full ({cap} sequences: {why})")
        seq = self._sequence(request_id, ids, params, resumed)
        self._claim_blocks(seq)
        self._held[request_id] = seq
        return Reservation(request_id, tuple(seq.block_table), seq.num_computed)

    def fence(self, request_id: str, tag: str) -> str:
        """Set a reservation aside under a new key, its blocks still held, so the request id
        is free for another attempt while a writer may still be filling those blocks.
        Returns the key to ``release`` once the writer is known to have stopped."""
        key = f"{request_id}/{tag}"
        self._held[key] = self._held.pop(request_id)
        return key

    def add_prefilled(
        self,
        request_id: str,
        first_token: int,
        first_logprob: float,
        *,
        num_cached_tokens: int = 0,
        first_top_logprobs: TopLogprobs | None = None,
    ) -> RequestOutput:
        """Join a reserved sequence whose prompt KV has arrived; returns its first event.

        ``num_cached_tokens``: prompt tokens the prefill worker served from its own cache
        instead of computing them; the request's events report it (usage.cached_tokens:
        tokens this request did not compute, whatever this pool already held).
        ``first_top_logprobs``: the first token's step's, when the request asks for them."""
        seq = self._held.pop(request_id)
        if self.staging is not None:
            # The prefill worker wrote the blocks after those present at reservation.
            self.staging.upload(seq.block_table[seq.num_computed // self.kv_spec.block_size :])
        if seq.generator is not None and not seq.params.greedy:
            skip_draws(seq.generator, self.model_config.vocab_size)  # token 0 came from prefill
        seq.num_computed = seq.num_tokens
        seq.num_cached_tokens = num_cached_tokens
        self.scheduler.add_running(seq)
        self.scheduler.advance(ScheduledSeq(seq, 0))  # publish the prompt's full blocks
        seq.num_exported_blocks = len(seq.block_hashes)  # the prefill worker's to export
        self.outputs.add(request_id, seq.params, seq.output_ids)
        return self._emit(seq, first_token, first_logprob, first_top_logprobs)

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request and free its blocks; False if it is not (or no longer) here."""
        if self.release(request_id):
            return True
        seq = self.scheduler.get(request_id)
        if seq is None:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self.outputs.remove(request_id)
        return True

    @property
    def num_held(self) -> int:
        """Prefill plans and decode reservations holding blocks outside the scheduler."""
        return len(self._held)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        # Reservations are sequences about to join: they count against the cap.
        step = self.scheduler.schedule(max(0, self.batch_cap - len(self._held)))
        self.num_preemptions += len(step.preempted)
        if not step.scheduled:
            return []
        now = time.monotonic()
        for it in step.scheduled:
            if it.seq.first_scheduled_time is None:
                it.seq.first_scheduled_time = now
        decode_only = all(it.num_tokens == 1 for it in step.scheduled)
        sampled = self.runner.execute(step.scheduled)
        for it in step.scheduled:
            self.scheduler.advance(it)
        outs = [self._emit(s.item.seq, s.token_id, s.logprob, s.top) for s in sampled]
        if decode_only:  # a step computing a prompt says nothing of a decode step's time
            seconds = time.perf_counter() - t0
            self.step_budget = self.step_budget.observed(len(step.scheduled), seconds)
        return outs

    def _emit(
        self, seq: Sequence, token_id: int, logprob: float, top: TopLogprobs | None = None
    ) -> RequestOutput:
        seq.output_ids.append(token_id)
        seq.output_logprobs.append(logprob)
        room = self.max_model_len - seq.num_tokens
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The mask admits only allowed tokens: a failed state, never a crash of the loop.
            log.error("grammar_refused_token", request_id=seq.request_id, token_id=token_id)
            delta, reason = "", FinishReason.ERROR
        else:
            complete = seq.grammar is not None and seq.grammar.complete
            delta, reason = self.outputs.process(seq.request_id, token_id, room, complete=complete)
        if reason is not None:
            self._export(seq)
            self.scheduler.finish(seq, reason)
            self.outputs.remove(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=(token_id,),
            new_logprobs=(logprob,),
            text_delta=delta,
            finished=reason is not None,
            finish_reason=None if reason is None else reason.value,
            num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids),
            # a hit may reach into a migrated request's resumed tokens: usage counts prompt
            num_cached_tokens=min(seq.num_cached_tokens, len(seq.prompt_ids)),
            new_top_logprobs=(top,) if top is not None else (),
        )

    # -- conveniences ----------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[CompletionResult]:
        """Run prompts to completion together (continuous batching); results in order."""
        plist = (
            list(params)
            if isinstance(params, (list, tuple))
            else [params or SamplingParams()] * len(prompts)
        )
        results: dict[str, CompletionResult] = {}
        order = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = self.add_request(prompt, p)
            seq = self.scheduler.get(rid)
            assert seq is not None
            results[rid] = CompletionResult(rid, list(seq.prompt_ids))
            order.append(rid)
        while self.has_unfinished():
            for out in self.step():
                r = results[out.request_id]
                r.token_ids.extend(out.new_token_ids)
                r.logprobs.extend(out.new_logprobs)
                r.top_logprobs.extend(out.new_top_logprobs)
                r.text += out.text_delta
                r.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    r.finish_reason = out.finish_reason
        return [results[r] for r in order]

    def stream(
        self, prompt: str | Seq[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Run one request alone, yielding its events as they are produced."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort_request(rid)

    def prompt_logits(self, prompt: str | Seq[int]) -> torch.Tensor:
        """float32 logits of the next token after ``prompt`` (scoring; engine must be idle)."""
        if self.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine")
        ids = self.encode_prompt(prompt)
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the context is {self.max_model_len}"
            )
        seq = Sequence("__score__", ids, SamplingParams(max_tokens=1), time.monotonic())
        seq.block_table = self.blocks.allocate(self.blocks.blocks_needed(len(ids)))
        try:
            return self.runner.logits_for([ScheduledSeq(seq, len(ids))])[0]
        finally:
            self.blocks.free(seq.block_table)
