"""The embedded rollout engine: batched prefill + decode with FP4 weights, activations and KV cache.

Small and explicit like gpt-fast's generate.py: ``prefill`` runs the right-padded prompts once with per-row
positions, ``decode_one_token`` feeds each row's last token at its own next position, and ``sample`` draws
on the device, so the loop only syncs with the host every ``sync_every`` steps to see whether all rows
are done. Rows finish independently; a finished row keeps running (its outputs are ignored) with its
position frozen at its last slot, so it never writes outside its own budget. On GPU the decode step is
captured once and replayed as a CUDA graph, kept for the next call of the same shape (rollout/decode.py), and FP4
layers attend on the packed cache directly (``fused_attention``). With ``max_batch`` below the number of prompts,
generate decodes in that many slots and refills a slot with the next prompt when its sequence ends (continuous
batching, rollout/slots.py), so long-tailed response lengths do not leave most of the batch idle.

The engine owns the model it is given: it converts it in place (FP4 modules, compute dtype).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from trace_lightning.exact import ExactForward, exact_kernels_for
from trace_lightning.guidance.compaction import route_bytes_per_token
from trace_lightning.guidance.identity import scan_tensors, weights_fingerprint
from trace_lightning.guidance.layout import RecordLayout, site_rows
from trace_lightning.model.model import Attention, ModelOutput, RMSNorm, Router
from trace_lightning.ops import backend_for, is_triton
from trace_lightning.rollout import memory
from trace_lightning.rollout.batch import CaptureSpec, FinishReason, RolloutBatch, SamplingParams
from trace_lightning.rollout.cache import FP4KVCache, KVCache
from trace_lightning.rollout.capture import FP4ActivationHook, Recorder, RowFakeQuantizer, fake_quantizer
from trace_lightning.rollout.convert import (
    FP4Module,
    check_weight_checksums,
    convert_to_fp4,
    fp4_checksum,
    fp4_weight_checksums,
)
from trace_lightning.rollout.decode import DecodeLoop, DecodeSession, DecodeState
from trace_lightning.rollout.live import LiveBatch
from trace_lightning.rollout.precision import FP4Precision, resolve_precision
from trace_lightning.rollout.sampling import sample, seed_keys, sequence_seeds
from trace_lightning.rollout.slots import SlotLoop, SlotState
from trace_lightning.rollout.traffic import StepTraffic, decode_step_traffic
from trace_lightning.timing import device_time

if TYPE_CHECKING:
    from trace_lightning.kernels import KernelOptions
    from trace_lightning.quant import FP4Format

GRAPH_LENGTH_STEP = 64
"""A kept decode session's cache length is the call's rounded up to a multiple of this."""
WORKSPACE_PROBE_TOKENS = 256
"""workspace_bytes measures forwards of at least this many positions (and 8 rows), where the row terms dominate."""
RING_CHECKS = 4
"""Host checks a record streamed to the host holds on the device between two flushes (Recorder.check)."""


class Engine:
    """Generates from ``model`` at ``precision`` ("fp32", "bf16" or an FP4Precision) on the model's device.

    ``prefill_dense_from``: forwards of at least this many tokens (large prefills) run dense GEMMs on FP4 weights
    dequantized for the call rather than the FP4 kernels (rollout/convert.py); None, the default until measured on
    the GPU, keeps the FP4 kernels everywhere.

    ``prefill_chunk``: prompts longer than this many positions prefill in forwards of that many positions each,
    every chunk attending to the cache the ones before it wrote, so the prefill's activations scale with batch x
    chunk, not batch x prompt (its workspace is what a large batch's peak memory exceeds the plan by); the
    sequences come out as an unchunked prefill gives them (tests/rollout/test_prefill_chunks.py). None: one
    forward.

    ``keep_decode_graph`` (with CUDA graphs on CUDA): a generate call keeps its decode session (KV cache, record
    buffers, captured step) for the next call of the same shape, which then replays from its first decode step
    instead of running two eager steps and capturing (an RL fit's rollouts all have one shape). The price: that
    cache and record stay allocated between calls (``release_decode_session`` frees them), and the record is handed
    over as a copy. Records streamed to the host are not kept."""

    def __init__(self, model: nn.Module, precision: FP4Precision | str = "bf16", *, backend: str = "auto",
                 sync_every: int = 8, fused_attention: bool | None = None, fused_norms: bool | None = None,
                 cuda_graph: bool = True, kernel_options: KernelOptions | None = None,
                 prefill_dense_from: int | None = None, prefill_chunk: int | None = None,
                 keep_decode_graph: bool = True, exact: bool = False) -> None:
        self.compute_dtype, self.fp4 = resolve_precision(precision)
        self.precision = precision
        self.config = model.config
        self.device = next(model.parameters()).device
        # exact: the invariant arithmetic (trace_lightning/exact), on the sim's ops for everything else; backend
        # "triton" runs its quantizer, cache append and GEMMs as Triton kernels with the same bits ("auto": torch's)
        chosen = backend_for(self.device, "sim" if exact and backend == "auto" else backend)
        self._exact_kernels = exact_kernels_for(backend) if exact else "torch"
        self.ops: ModuleType = backend_for(self.device, "sim") if exact else chosen
        self.sync_every = max(1, sync_every)
        # decode steps replay as one CUDA graph on GPU (rollout/decode.py); the exact forward's too where its FP4
        # steps are Triton kernels (its torch GEMMs read group sizes back to the host). The graph attends over the
        # whole cache: masked keys add exact zeros to the exact attention's trees, so no bit changes. A step that
        # cannot be captured runs eagerly, with a warning.
        self.cuda_graph = cuda_graph and (not exact or self._exact_kernels == "triton")
        self.keep_decode_graph = keep_decode_graph
        self._session: DecodeSession | None = None
        # attention over the packed FP4 cache (ops.fp4_kv_attention) on every backend: on Triton one kernel reads the
        # 4.5-bit K/V (the dequantize-then-SDPA fallback would move more bytes than a bf16 cache); on every backend
        # a query's result then depends on its own keys only, not on how many masked slots follow them (the batch's
        # longest row), so a sequence decodes bit for bit as it would alone (tests/rollout/test_engine.py)
        self.fused_attention = True if fused_attention is None else fused_attention
        if kernel_options is not None and not is_triton(self.ops):
            raise ValueError(f"kernel_options configure the Triton kernels; this engine runs {self.ops.__name__}")
        self.kernel_options = kernel_options  # how the Triton kernels launch (autotune, shapes, PDL); None: defaults
        self.policy_version = 0
        master = model.state_dict()
        self._digests = check_weights(master, "Engine")  # byte digests before any FP4 conversion or cast
        self._shapes = {name: tuple(t.shape) for name, t in master.items()}  # what update_weights accepts
        model.eval().requires_grad_(False)
        self._fp4_weights: dict[str, tuple[FP4Module, str]] = {}
        with torch.no_grad():
            if self.fp4 is not None and self.fp4.weights:  # quantize the master weights before any cast
                self._fp4_weights = convert_to_fp4(model, self.fp4.weight_format, self.ops, self.compute_dtype)
            for p in model.parameters():
                p.data = p.data.to(self.compute_dtype)
        self.fused_norms = is_triton(self.ops) if fused_norms is None else fused_norms  # 1 launch per norm, not ~6
        if self.fused_norms:  # and the q / k head norm + RoPE, and the router's top-k: one launch each instead of ~6
            for m in model.modules():
                if isinstance(m, RMSNorm):
                    m.fused = self.ops.rms_norm
                elif isinstance(m, Attention):
                    m.fused_rope = self.ops.rope
                elif isinstance(m, Router):
                    m.fused = self.ops.route_topk
        self._dense: dict[str, Tensor] = dict(model.state_dict(keep_vars=True))
        self.model = model
        if prefill_dense_from is not None and (not _is_integer(prefill_dense_from) or prefill_dense_from < 1):
            raise ValueError(f"prefill_dense_from must be None or an integer >= 1, got {prefill_dense_from!r}")
        for module, _ in self._fp4_weights.values():  # forwards of this many tokens (prefills) run dense GEMMs
            module.dense_from = prefill_dense_from
        self.prefill_dense_from = prefill_dense_from if self._fp4_weights else None
        if prefill_chunk is not None and (not _is_integer(prefill_chunk) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be None or an integer >= 1, got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.exact = self._exact_forward(exact)
        self._workspace: dict[tuple[int, int, RecordLayout | None, bool], tuple[int, int, int]] = {}  # workspace lines

    # ---- generation --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams, capture: CaptureSpec | None = None, *,
                 max_batch: int | None = None, one_off: bool = False) -> RolloutBatch:
        """Sample a response per prompt; see RolloutBatch for what comes back and how rows align.

        max_batch: decode at most this many sequences at once (continuous batching, rollout/slots.py: a slot
        whose sequence ends takes the next prompt); None or >= len(prompts): all prompts as one static batch.
        A sequence's outputs depend on it no more than on the batch it shares (tests/rollout/test_continuous.py).
        The KV cache then holds max_batch rows, the records (routes, captures) one row per prompt.

        one_off: a call of a shape the next calls will not repeat (an RL fit's audit rollout, every layer's codes):
        it uses the kept decode session if it has this call's shape, else builds its own and frees it after,
        leaving the kept session to the next call instead of replacing it (while it runs, both are allocated)."""
        prompts, max_new, seeds = self._validate(prompts, params)
        slots = _slot_count(max_batch, len(prompts))
        if slots < len(prompts):
            return self._generate_continuous(prompts, max_new, seeds, params, capture, slots, one_off)
        dev = self.device
        lens = [len(p) for p in prompts]
        P, N, S = max(lens), max(max_new), max(n + m for n, m in zip(lens, max_new, strict=True))
        stop_ids = list(params.stop_token_ids)
        session = self._decode_session(len(prompts), S, N, P, capture, params, len(stop_ids), one_off=one_off)
        recorder, hook, cache, state, loop = session.recorder, session.hook, session.cache, session.state, session.loop
        assert isinstance(state, DecodeState)
        recorder.begin(S)
        session.keys.copy_(seed_keys(seeds, dev))
        lens_t, max_new_t = torch.tensor(lens, device=dev), torch.tensor(max_new, device=dev)
        state.stop.copy_(torch.tensor(stop_ids, dtype=torch.long, device=dev))  # the first draw's banned ids

        start = time.perf_counter()
        tok, lp = loop.draw(self.prefill(prompts, cache, hook, recorder), step=0)
        recorder.flush()
        state.begin(tok, lp, lens_t, max_new_t, state.stop.clone())
        prefill_s = device_time(dev) - start  # the prefill's device time, not its launch time
        loop.begin()
        recorder.step, loop.on_check = state.step, functools.partial(recorder.check, self.sync_every)
        steps = 1 + loop.run(N - 1, visible=lambda i: min(P + i, S))
        recorder.flush()
        self._check_finite_logprobs(state.logprobs)
        out = self._collect(prompts, max_new, state.tokens, state.logprobs, params, recorder, capture)
        out.stats = {"prefill_s": prefill_s, "decode_s": time.perf_counter() - start - prefill_s,
                     "decode_steps": float(steps), "new_tokens": float(sum(len(r) for r in out.responses)),
                     "graph_steps": float(loop.graph_steps), "capture_s": loop.capture_s, "refills": 0.0}
        return out

    def open_live(self, rows: int, max_len: int, capture: CaptureSpec | None = None) -> LiveBatch:
        """`rows` sequences whose KV cache stays live between forwards: `feed` prefills them and extends them with
        sampled or forced tokens (an environment's reply in a multi-turn rollout) without prefilling again
        (rollout/live.py). Eager forwards, no CUDA graph."""
        return LiveBatch(self, rows, max_len, capture)

    def _decode_session(self, batch: int, length: int, max_new: int, prompt_len: int, capture: CaptureSpec | None,
                        params: SamplingParams, n_stop: int, slots: int | None = None,
                        one_off: bool = False) -> DecodeSession:
        """The buffers, cache, recorder and decode loop of a generate call of `batch` sequences (in `slots` decode
        slots: continuous batching): the kept session when this call has its key, else a new one, kept (replacing
        the last, unless `one_off`) where decode steps replay as CUDA graphs. A kept session's cache and record are
        GRAPH_LENGTH_STEP-rounded in length, so calls whose prompts differ a little in length share it (the FP4
        attention reads keys up to each query's own position only)."""
        dev = self.device
        kept_len = self._kept_length(length, capture)
        keep, max_len = kept_len is not None, kept_len or length
        layout = self.record_layout(capture)
        key = (batch, slots, max_len, max_new, layout, capture is not None, params.temperature, params.top_k,
               params.top_p, n_stop, params.min_new_tokens)
        kept = self._session
        if keep and kept is not None and kept.key == key:
            return kept
        if one_off:
            keep, max_len = False, length
        else:
            self._session = None  # the last session's memory goes before the new one's is allocated
        recorder, hook, cache = self._call_buffers(capture, batch, max_len, slots, self._ring(capture, prompt_len))
        recorder.kept = keep
        use_graph = self.cuda_graph and dev.type == "cuda"
        state: DecodeState | SlotState = (DecodeState.empty(batch, max_new, n_stop, dev) if slots is None
                                          else SlotState.empty(batch, max_new, slots, n_stop, dev))
        sampling = functools.partial(sample, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                     banned=state.stop, banned_until=params.min_new_tokens)  # the call's stop ids
        if slots is None:
            keys = torch.zeros(batch, 2, dtype=torch.long, device=dev)
            loop: DecodeLoop = DecodeLoop(lambda t, pos: self.decode_one_token(t, pos, cache, hook, recorder),
                                          functools.partial(sampling, keys=keys), state, cache, self.sync_every,
                                          use_graph)
        else:
            assert isinstance(state, SlotState)
            slot_state, keys = state, state.keys

            def slot_logits(tokens: Tensor, positions: Tensor) -> Tensor:
                recorder.rows = slot_state.slot_seq
                return self.decode_one_token(tokens, positions, cache, hook, recorder)

            loop = SlotLoop(slot_logits, sampling, state, cache, self.sync_every, use_graph)
        session = DecodeSession(key, cache, recorder, hook, keys, state, loop)
        if keep:
            self._session = session
        return session

    def _call_buffers(self, capture: CaptureSpec | None, batch: int, max_len: int, slots: int | None = None,
                      ring: int = 0) -> tuple[Recorder, FP4ActivationHook | None, KVCache]:
        """A call's recorder (records and routes by sequence), activation hook and KV cache (by decode row: `slots`
        rows under continuous batching, else one a sequence), recording only when `capture` asks."""
        c = self.config
        recorder = Recorder(self.record_layout(capture), batch, max_len, c.n_layers, c.top_k, c.n_experts, self.device,
                            self.ops, rows=slots, ring=ring)
        recording = recorder if capture else None
        return recorder, self._hook(recording), self._cache(slots or batch, max_len, recording)

    def _keeps_decode_graphs(self) -> bool:
        """Whether generate calls keep their decode session for the next call (captured CUDA graphs)."""
        return self.keep_decode_graph and self.cuda_graph and self.device.type == "cuda"

    def _kept_length(self, length: int, capture: CaptureSpec | None) -> int | None:
        """The buffers' length of a call of `length` positions whose decode session is kept for the next call
        (GRAPH_LENGTH_STEP-rounded); None where it is not kept (no graphs kept, or a record streamed to the host)."""
        if not self._keeps_decode_graphs() or (capture is not None and capture.stream_to_host):
            return None
        return min(-(-length // GRAPH_LENGTH_STEP) * GRAPH_LENGTH_STEP, self.config.max_seq_len)

    def release_decode_session(self) -> None:
        """Free the kept decode session (its KV cache, record buffers and CUDA graph); the next call builds anew."""
        self._session = None

    def _generate_continuous(self, prompts: list[list[int]], max_new: list[int], seeds: list[int],
                             params: SamplingParams, capture: CaptureSpec | None, slots: int,
                             one_off: bool = False) -> RolloutBatch:
        """generate with `slots` decode slots: outputs and records by sequence, the KV cache by slot."""
        n, dev = len(prompts), self.device
        lens = [len(p) for p in prompts]
        S = max(m + k for m, k in zip(lens, max_new, strict=True))
        stop_ids = list(params.stop_token_ids)
        session = self._decode_session(n, S, max(max_new), max(lens), capture, params, len(stop_ids), slots=slots,
                                       one_off=one_off)
        recorder, hook, cache, state, loop = session.recorder, session.hook, session.cache, session.state, session.loop
        assert isinstance(state, SlotState) and isinstance(loop, SlotLoop)
        recorder.begin(S)
        state.begin(seed_keys(seeds, dev), torch.tensor(lens, device=dev), torch.tensor(max_new, device=dev),
                    torch.tensor(stop_ids, dtype=torch.long, device=dev))
        prefill_s = 0.0

        def prefill(slot_ids: list[int], seqs: list[int], fresh: bool) -> Tensor:
            nonlocal prefill_s
            start = time.perf_counter()
            recorder.flush()  # a refill's prefill writes its prompt's columns: what the ring holds goes first
            recorder.rows, recorder.step = torch.tensor(seqs, device=dev), None
            logits = self._prefill_rows([prompts[q] for q in seqs], slot_ids, cache, fresh, hook, recorder)
            recorder.flush()
            recorder.step = state.step
            prefill_s += device_time(dev) - start
            return logits

        loop.load(prefill, lens, max_new)
        start = time.perf_counter()
        loop.on_check = functools.partial(recorder.check, self.sync_every)  # at most sync_every steps apart
        steps = 1 + loop.run()
        recorder.flush()
        elapsed = time.perf_counter() - start
        self._check_finite_logprobs(state.logprobs)
        out = self._collect(prompts, max_new, state.tokens, state.logprobs, params, recorder, capture)
        out.stats = {"prefill_s": prefill_s, "decode_s": elapsed - prefill_s, "decode_steps": float(steps),
                     "new_tokens": float(sum(len(r) for r in out.responses)), "graph_steps": float(loop.graph_steps),
                     "capture_s": loop.capture_s, "refills": float(loop.refills)}
        return out

    def _ring(self, capture: CaptureSpec | None, prompt_len: int) -> int:
        """Ring columns of a record streamed to the host: the longest prompt (a prefill writes at its positions) or
        the steps of RING_CHECKS host checks, whichever is more; 0: the record stays on the device."""
        if capture is None or not capture.stream_to_host:
            return 0
        return max(prompt_len, self.sync_every * RING_CHECKS)

    def _prefill_rows(self, prompts: list[list[int]], rows: list[int], cache: KVCache, fresh: bool,
                      hook: FP4ActivationHook | None, recorder: Recorder) -> Tensor:
        """prefill into cache rows `rows` -> logits (k, V). Into a fresh cache (the first fill of every row) the
        forward writes directly; otherwise it runs on a k-row staging cache whose rows are then copied into
        `rows` (the forward and ops.kv_append write rows by batch index; see rollout/cache.py)."""
        if fresh:
            return self.prefill(prompts, cache, hook, recorder)
        staging = self._cache(len(rows), cache.max_len, recorder if recorder.layout is not None else None)
        logits = self.prefill(prompts, staging, hook, recorder)
        cache.copy_rows(staging, torch.tensor(rows, device=self.device))
        return logits

    def prefill(self, prompts: list[list[int]], cache: KVCache, hook: FP4ActivationHook | None,
                recorder: Recorder) -> Tensor:
        """Right-padded prompts in one forward -> logits (B, V) at each prompt's last token."""
        B, P = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        positions = torch.arange(P, device=self.device).expand(B, P)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        chunk = min(P, self.prefill_chunk or P)
        logits: Tensor | None = None
        for a in range(0, P, chunk):  # one forward unless prefill_chunk < P
            b = min(P, a + chunk)
            cache.visible = b
            out = self._forward(ids[:, a:b], positions[:, a:b], cache, hook, recorder,
                                logits_at=(last - a).clamp(0, b - a - 1))[:, 0]  # (B, V)
            ends_here = ((last >= a) & (last < b))[:, None]  # rows whose last prompt token is in this chunk
            logits = out if logits is None else torch.where(ends_here, out, logits)
        assert logits is not None
        return logits

    def decode_one_token(self, tokens: Tensor, positions: Tensor, cache: KVCache, hook: FP4ActivationHook | None,
                         recorder: Recorder) -> Tensor:
        """tokens, positions (B, 1) -> next-token logits (B, V)."""
        return self._forward(tokens, positions, cache, hook, recorder)[:, -1]

    def _forward(self, ids: Tensor, positions: Tensor, cache: KVCache, hook: FP4ActivationHook | None,
                 recorder: Recorder, logits_at: Tensor | None = None) -> Tensor:
        recorder.positions = positions
        options = self.kernel_options
        if self.exact is not None:  # trace_exact: the forward training repeats bit for bit (hook and records unused)
            out: ModelOutput = self.exact(ids, positions=positions, cache=cache, logits_at=logits_at)
        else:
            with self.ops.kernel_options(options) if options is not None else contextlib.nullcontext():
                out = self.model(ids, positions=positions, cache=cache, hook=hook, return_routes=True,
                                 logits_at=logits_at)
        recorder.observe_routes(out.routes)
        return out.logits

    # ---- pieces of a generate call -----------------------------------------------------------------
    def _exact_forward(self, exact: bool) -> ExactForward | None:
        """The batch-invariant forward (trace_lightning/exact) when `exact`: NVFP4 weights, activations and KV cache
        (what it computes exactly); None otherwise."""
        if not exact:
            return None
        fp4 = self.fp4
        if fp4 is None or fp4.fmt != "nvfp4" or not (fp4.weights and fp4.activations and fp4.kv):
            raise ValueError(f"exact=True needs NVFP4 weights, activations and KV cache; precision is "
                             f"{self.precision!r}")
        return ExactForward(self.model, self.compute_dtype, fp4.fmt, kernels=self._exact_kernels)

    def _fake_quantizer(self) -> RowFakeQuantizer:
        assert self.fp4 is not None
        if self.fp4.fmt == "mxfp4":
            return fake_quantizer(functools.partial(self.ops.quantize_mxfp4, mode=self.fp4.mx_mode))
        fused = getattr(self.ops, "fake_quantize_nvfp4_rows", None)
        return fused if fused is not None else fake_quantizer(self.ops.quantize_nvfp4_rows)

    def _hook(self, recorder: Recorder | None) -> FP4ActivationHook | None:
        if self.fp4 is None or not self.fp4.activations:
            return None
        return FP4ActivationHook(self._fake_quantizer(), recorder)

    def _cache(self, batch: int, max_len: int, recorder: Recorder | None) -> KVCache:
        c, dtype = self.config, self.compute_dtype
        if self.fp4 is None or not self.fp4.kv:
            return KVCache(c, batch, max_len, dtype, self.device)
        return FP4KVCache(c, batch, max_len, dtype, self.device, self.ops, self.fp4.activation_format, recorder,
                          fused_attention=self.fused_attention)

    def record_layout(self, capture: CaptureSpec | None) -> RecordLayout | None:
        """How a token's record is packed for this capture request: the requested sites that this precision
        quantizes (k / v with an FP4 cache, the others with FP4 activations) in the quantized layers."""
        if capture is None:
            return None
        fp4 = self.fp4
        if fp4 is None or not (fp4.activations or fp4.kv):
            raise ValueError(f"capture needs FP4 activations or an FP4 KV cache; precision is {self.precision!r}")
        c = self.config
        quantized = {s for s in site_rows(c) if (fp4.kv if s in ("k", "v") else fp4.activations)}
        sites = sorted(capture.site_set() & quantized)
        layers = [i for i in capture.layer_set(c.n_layers) if c.is_quantized_layer(i)]
        return RecordLayout.for_model(c, fp4.activation_format, capture.mode, [(i, s) for i in layers for s in sites])

    def _validate(self, prompts: list[list[int]],
                  params: SamplingParams) -> tuple[list[list[int]], list[int], list[int]]:
        """Prompts as plain int lists, per-prompt max_new_tokens and seeds; every bad input is a ValueError
        naming its prompt. Integer types (numpy, 0-d tensors) are accepted; bools and floats are not."""
        if not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("generate needs a non-empty list of prompts (lists of token ids)")
        n, V, S = len(prompts), self.config.vocab_size, self.config.max_seq_len
        max_new = _per_prompt(params.max_new_tokens, n, "max_new_tokens")
        seeds = (sequence_seeds(_as_id(params.seed, "seed"), n) if _is_integer(params.seed)
                 else _per_prompt(params.seed, n, "seed"))
        for t in params.stop_token_ids:
            if not _is_integer(t) or not 0 <= int(t) < V:
                raise ValueError(f"stop token id {t!r} is not an id in [0, {V})")
        ids = [_prompt_ids(i, p, V) for i, p in enumerate(prompts)]
        for i, (p, m) in enumerate(zip(ids, max_new, strict=True)):
            if m < 1:
                raise ValueError(f"prompt {i}: max_new_tokens must be >= 1, got {m}")
            if len(p) + m > S:
                raise ValueError(f"prompt {i}: {len(p)} prompt tokens + {m} new tokens exceed the model's "
                                 f"max_seq_len {S}")
        return ids, max_new, seeds

    def _check_finite_logprobs(self, logprobs: Tensor) -> None:
        """Non-finite logits mean non-finite weights (or activations): fail naming the tensor, never return
        token 0 with NaN logprobs. One check per call, on the host sync the result needs anyway."""
        if bool(torch.isfinite(logprobs).all()):
            return
        check_weights(self._dense, "generate")
        raise ValueError("generate: non-finite logprobs although every weight is finite (an activation "
                         "overflowed)")

    def _collect(self, prompts: list[list[int]], max_new: list[int], tokens: Tensor, logprobs: Tensor,
                 params: SamplingParams, recorder: Recorder, capture: CaptureSpec | None) -> RolloutBatch:
        """One host transfer: cut each row at its first stop token or at its max_new_tokens. Routes and records
        stay on the device as whole-batch tensors."""
        tokens, logprobs, budget = tokens.cpu(), logprobs.cpu(), torch.tensor(max_new)
        stops = torch.isin(tokens, torch.tensor(list(params.stop_token_ids), dtype=tokens.dtype))
        stops &= torch.arange(tokens.shape[1]) < budget[:, None]
        stopped = stops.any(dim=1)
        ends = torch.where(stopped, stops.int().argmax(dim=1) + 1, budget).tolist()  # argmax: the first stop
        responses = [row[:end] for row, end in zip(tokens.tolist(), ends, strict=True)]
        out_lps = [lp[:end] for lp, end in zip(logprobs.tolist(), ends, strict=True)]
        reasons: list[FinishReason] = ["stop" if s else "length" for s in stopped.tolist()]
        lengths = torch.tensor([len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True)],
                               device=self.device)
        with torch.inference_mode(False):  # training reads (and may modify) these: normal tensors, not inference ones
            routes = recorder.route_table(lengths)
            record = (recorder.batch_record(lengths, routes, self.policy_version, self.model_id)
                      if capture is not None else None)
        return RolloutBatch(
            prompts=[list(p) for p in prompts], responses=responses, logprobs=out_lps, finish_reasons=reasons,
            policy_version=self.policy_version, route_table=routes, record=record, capture=capture,
        )

    # ---- memory ------------------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        """Bytes of everything the engine computes with: dense parameters and the FP4 weights (codes, scales)."""
        held: list[Tensor] = []
        for module, _ in self._fp4_weights.values():
            quantized = module.q.values() if isinstance(module.q, dict) else [module.q]
            dense = module.dense.values() if isinstance(module.dense, dict) else [module.dense]
            held += [v for q in quantized for f in dataclasses.fields(q) if isinstance(v := getattr(q, f.name), Tensor)]
            held += [d for d in dense if d is not None]
        return memory.tensor_bytes(self.model, held)

    @property
    def kv_format(self) -> FP4Format | None:
        """The KV cache's FP4 format (None: a dense cache in the compute dtype)."""
        return self.fp4.activation_format if self.fp4 is not None and self.fp4.kv else None

    def decode_step_traffic(self, batch: int, context: float, capture: CaptureSpec | None = None) -> StepTraffic:
        """Bytes a decode step of `batch` rows at `context` cached positions must move: its roofline's numerator."""
        layout = self.record_layout(capture)
        record = (layout.width if layout is not None else 0) + route_bytes_per_token(self.config)
        return decode_step_traffic(self.config, self.weight_bytes_by_name(), batch, context,
                                   memory.kv_bytes_per_token(self.config, self.compute_dtype, self.kv_format), record)

    def weight_bytes_by_name(self) -> dict[str, int]:
        """Each parameter's bytes as the engine computes with it: FP4 codes and scales, or the dense tensor (what a
        decode step reads of it: rollout/traffic.py)."""
        held: dict[str, int] = {}
        for name, (module, key) in self._fp4_weights.items():
            q = module.q[key] if isinstance(module.q, dict) else module.q
            held[name] = sum(v.numel() * v.element_size() for f in dataclasses.fields(q)
                             if isinstance(v := getattr(q, f.name), Tensor))
        for name, t in self._dense.items():
            if name not in held and not (self.config.tie_embeddings and name == "output.weight"):  # tied: once
                held[name] = t.numel() * t.element_size()
        return held

    def memory_plan(self, batch: int, max_len: int, capture: CaptureSpec | None = None, *,
                    max_batch: int | None = None, prompt_len: int | None = None,
                    workspace: bool = False) -> memory.MemoryPlan:
        """What a generate call of `batch` sequences of up to `max_len` positions (prompt + new tokens) holds on
        the device: weights, KV cache, the packed record, routes (and, with max_batch slots, a refill's staging
        cache), from shapes alone; with `workspace`, also its largest forward's transient bytes, measured
        (workspace_bytes: the prefill of `prompt_len` positions, default max_len, in prefill_chunk pieces, or a
        decode step). A record streamed to the host (capture.stream_to_host) costs the device a ring as long as the
        longest prompt or the check interval. Where calls keep their decode session (CUDA graphs), its buffers are
        GRAPH_LENGTH_STEP-rounded and the record is handed over as a copy: both counted (a one_off call of another
        shape than the kept session's allocates its own buffers beside it, which no plan of one call counts)."""
        layout = self.record_layout(capture)
        slots, prompt = _slot_count(max_batch, batch), max_len if prompt_len is None else prompt_len
        plan = memory.plan(self.config, self.weight_bytes(), batch, max_len, self.compute_dtype, self.kv_format,
                           layout.width if layout is not None else 0, slots, self._ring(capture, prompt),
                           self._kept_length(max_len, capture))
        if not workspace:
            return plan
        return dataclasses.replace(plan, workspace=self._call_workspace(slots, prompt, max_len, capture))

    def _call_workspace(self, rows: int, prompt_len: int, max_len: int, capture: CaptureSpec | None) -> int:
        """The larger of a prefill forward's (rows x one prefill chunk) and a decode step's workspace."""
        return max(self.workspace_bytes(rows, tokens, capture, context)
                   for tokens, context in self._forwards(prompt_len, max_len))

    def _forwards(self, prompt_len: int, max_len: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(positions, context) of a generate call's forwards: a prefill chunk and a decode step, where context is
        the cache length a probe of the forward attends over. The Triton engine's attention reads an NVFP4 (or dense)
        cache where it lies, so its decode step is probed over a cache one position long: at long contexts its split
        partials (kernels/kv.py) are bigger, but attention_splits bounds them (at most 103 MB for the qwen3-30b-a3b
        shape on an H200's 132 SMs, over batches 1-512 and contexts to 40K: batch 404 at 32K in 16 splits), which the
        callers' reserve covers. The sim's ops (the CPU, and trace_exact's engine), an MXFP4 cache and the unfused
        attention dequantize the cache's visible window into dense tensors to attend over it, a transient that grows
        with the context (2.2x a 32 x 172 call's plan on the CPU when probed over one position): there both forwards
        are probed over the call's whole context."""
        chunk = min(prompt_len, self.prefill_chunk or prompt_len)
        kv = self.kv_format
        if is_triton(self.ops) and (kv is None or (kv.kind == "nvfp4" and self.fused_attention)):
            return (chunk, chunk), (1, 1)
        return (chunk, max(chunk, prompt_len)), (1, max(max_len, 1))

    def workspace_bytes(self, rows: int, tokens: int, capture: CaptureSpec | None = None,
                        context: int | None = None) -> int:
        """Transient device bytes of one forward of `rows` x `tokens` positions (a prefill chunk; tokens 1: a decode
        step) with this capture's recording, logits at each row's last position included. Measured
        (memory.peak_transient_bytes, each after an unmeasured forward that compiles and allocates what stays) at r
        and 2r rows, r the rows of >= WORKSPACE_PROBE_TOKENS positions (at least 8), and extrapolated in the rows,
        whose work is independent: the peak is the largest of a few terms linear in the rows, and past a few rows
        the steepest dominates (the sim's per-call weight dequantization, say, only below that). Below r rows: the
        r-row figure. A forward that takes the dense prefill path (rows x tokens >= prefill_dense_from) has its own
        line, probed on forwards that take it too. `context`: the cache length the forward's positions end at (default
        `tokens`: a cache they fill). Cached per (tokens, context, record layout, path)."""
        r, at_r, per_row = self._workspace_line(tokens, capture, self._takes_dense_path(rows, tokens), context)
        return at_r + per_row * max(rows - r, 0)

    def _takes_dense_path(self, rows: int, tokens: int) -> bool:
        """Whether a forward of rows x tokens positions runs dense GEMMs on dequantized weights (prefill_dense_from)."""
        return self.prefill_dense_from is not None and rows * tokens >= self.prefill_dense_from

    def _workspace_line(self, tokens: int, capture: CaptureSpec | None, dense: bool = False,
                        context: int | None = None) -> tuple[int, int, int]:
        """(probe rows r, bytes at r rows, bytes per further row) of a forward of `tokens` positions at the end of a
        cache of `context` (default `tokens`); `dense`: of the forwards that take the dense prefill path (probed at r
        rows that take it)."""
        context = max(tokens, context or tokens)
        key = (tokens, context, self.record_layout(capture), dense)
        if key not in self._workspace:
            r = max(8, -(-WORKSPACE_PROBE_TOKENS // context))  # a row's terms dominate from a few hundred positions
            if dense:
                r = max(r, self._dense_rows(tokens))
            at_r, at_2r = (self._measure_forward(rows, tokens, capture, context) for rows in (r, 2 * r))
            self._workspace[key] = (r, at_r, max(at_2r - at_r, 0) // r)
        return self._workspace[key]

    def _dense_rows(self, tokens: int) -> int:
        """The fewest rows whose forward of `tokens` positions takes the dense prefill path."""
        assert self.prefill_dense_from is not None
        return -(-self.prefill_dense_from // tokens)

    @torch.inference_mode()
    def _measure_forward(self, rows: int, tokens: int, capture: CaptureSpec | None, context: int | None = None) -> int:
        """Transient bytes of a forward of rows x tokens positions, the last `tokens` of a cache of `context`."""
        c, dev = self.config, self.device
        context = max(tokens, context or tokens)
        recorder, hook, cache = self._call_buffers(capture, rows, context)
        ids = torch.full((rows, tokens), min(3, c.vocab_size - 1), dtype=torch.long, device=dev)
        positions = torch.arange(context - tokens, context, device=dev).expand(rows, tokens)
        last = torch.full((rows,), tokens - 1, device=dev)
        cache.visible = context

        def forward() -> Tensor:
            return self._forward(ids, positions, cache, hook, recorder, logits_at=last)

        forward()
        return memory.peak_transient_bytes(forward, dev)

    def max_batch(self, max_len: int, budget_bytes: int, *, capture: CaptureSpec | None = None,
                  reserve_bytes: int = 0, prompt_len: int | None = None, workspace: bool = False) -> int:
        """The largest batch whose memory_plan fits in budget_bytes with reserve_bytes left; with `workspace`, the
        plan's measured workspace (which grows with the batch: a prefill's rows) counted too."""
        one = self.memory_plan(1, max_len, capture)
        per_sequence = one.total - one.weights
        if not workspace:
            return memory.largest_batch(per_sequence, one.weights, budget_bytes, reserve_bytes)
        prompt = max_len if prompt_len is None else prompt_len
        return min(self._largest_for(t, context, capture, per_sequence, one.weights, budget_bytes, reserve_bytes)
                   for t, context in self._forwards(prompt, max_len))

    def _largest_for(self, tokens: int, context: int, capture: CaptureSpec | None, per_sequence: int, weights: int,
                     budget: int, reserve: int) -> int:
        """The largest batch that fits with the workspace of its forwards of `tokens` positions (of `context`): below
        the dense prefill path's rows the FP4 kernels' line, from them on the dense path's (its dequantized weights)."""
        n = self._largest_with(self._workspace_line(tokens, capture, context=context), per_sequence, weights, budget,
                               reserve)
        if self.prefill_dense_from is None or n < self._dense_rows(tokens):
            return n
        dense = self._largest_with(self._workspace_line(tokens, capture, dense=True, context=context), per_sequence,
                                   weights, budget, reserve)
        return dense if dense >= self._dense_rows(tokens) else self._dense_rows(tokens) - 1

    @staticmethod
    def _largest_with(line: tuple[int, int, int], per_sequence: int, weights: int, budget: int, reserve: int) -> int:
        """The largest batch whose plan and the workspace `line` (workspace_bytes' terms) fit."""
        r, at_r, per_row = line
        n = memory.largest_batch(per_sequence + per_row, weights + at_r - per_row * r, budget, reserve)
        return n if n >= r else min(r - 1, memory.largest_batch(per_sequence, weights + at_r, budget, reserve))

    # ---- weight sync ---------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, named_tensors: Mapping[str, Tensor], version: int) -> dict[str, str]:
        """Load master weights by name (any subset of the model's state dict), re-quantizing the FP4 ones
        from exactly the tensors given; then set the policy version. All or nothing: every tensor (name,
        shape, dtype, finite values) and the version are checked before anything changes.

        Returns the given tensors' byte digests (guidance/identity.py `tensor_digests`), the ones `model_id` is now
        made of: the trainer's side of the record identity, without a second pass over the same tensors."""
        if not _is_integer(version) or int(version) < self.policy_version:
            raise ValueError(f"update_weights: policy version {version!r} must be an integer >= the current "
                             f"{self.policy_version} (versions never go backwards)")
        for name, t in named_tensors.items():
            self._check_update(name, t)
        digests = check_weights(named_tensors, "update_weights")
        self._digests.update(digests)
        moved = False
        for name, t in named_tensors.items():
            if name in self._fp4_weights:
                module, key = self._fp4_weights[name]
                moved |= module.set_weight(key, t.detach().to(self.device))
            else:  # copy_ casts and moves in its one kernel
                self._dense[name].copy_(t.detach())
        if moved:  # a kept graph would read the weights' old addresses
            self.release_decode_session()
        self.policy_version = int(version)
        return digests

    def _check_update(self, name: str, t: Tensor) -> None:
        """The master shape from construction: reading it off an FP4 module would convert its weight from the
        kernels' layout back to stored order (~55 ops a tensor, a third of a sync on the GPU)."""
        shape = self._shapes.get(name) if name in self._fp4_weights or name in self._dense else None
        if shape is None:
            raise ValueError(f"update_weights: unknown tensor {name!r}")
        if not isinstance(t, Tensor):
            raise ValueError(f"update_weights: {name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"update_weights: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")

    @property
    def model_id(self) -> str:
        """Fingerprint of the master weights the engine was built or last updated from (records carry it)."""
        return weights_fingerprint(self._digests)

    def weight_checksums(self) -> dict[str, str]:
        """{name: sha256 of the FP4 bytes the engine computes with} for every FP4 weight."""
        return {name: fp4_checksum(module.quantized()[key]) for name, (module, key) in self._fp4_weights.items()}

    def verify_weights(self, named_tensors: Mapping[str, Tensor]) -> None:
        """Audit: raise WeightChecksumError naming every FP4 weight whose bytes differ from quantizing
        ``named_tensors`` (the trainer's master weights) the trainer's way."""
        if self.fp4 is None or not self.fp4.weights:
            return
        expected = fp4_weight_checksums(named_tensors, self.fp4.weight_format, config=self.config)
        check_weight_checksums(expected, self.weight_checksums())


WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_weights(named: Mapping[str, Tensor], where: str) -> dict[str, str]:
    """ValueError naming the first weight that is not a float tensor or holds NaN or inf: such weights would
    sample token 0 with NaN logprobs, or (NaN in k_proj) be zeroed by attention into finite garbage. Returns the
    weights' byte digests (guidance/identity.py), taken in the same scan: one host transfer for all tensors."""
    for name, t in named.items():
        if t.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"{where}: weight {name!r} has dtype {t.dtype}; expected one of "
                             f"{', '.join(str(d) for d in WEIGHT_DTYPES)}")
    digests, finite = scan_tensors(named)
    bad = next((name for name, ok in finite.items() if not ok), None)
    if bad is None:
        return digests
    raise ValueError(f"{where}: weight {bad!r} holds {int((~torch.isfinite(named[bad])).sum())} non-finite (NaN or "
                     "inf) values")


def _slot_count(max_batch: object, n: int) -> int:
    """The number of decode slots: max_batch (an int >= 1) capped at n; None: n (one static batch)."""
    if max_batch is None:
        return n
    if not _is_integer(max_batch) or int(operator.index(max_batch)) < 1:
        raise ValueError(f"max_batch must be None or an integer >= 1, got {max_batch!r}")
    return min(int(operator.index(max_batch)), n)


def _is_integer(value: object) -> bool:
    """Python, numpy and 0-d torch integers; not bools (True is not a token id) and not floats."""
    if isinstance(value, bool) or getattr(value, "dtype", None) == torch.bool or type(value).__name__ == "bool_":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _as_id(value: object, what: str) -> int:
    if not _is_integer(value):
        raise ValueError(f"{what} must be an integer, got {value!r} ({type(value).__name__})")
    return int(operator.index(value))


def _prompt_ids(i: int, prompt: object, vocab: int) -> list[int]:
    if isinstance(prompt, str | bytes) or not isinstance(prompt, Sequence | Tensor):
        raise ValueError(f"prompt {i} must be a list of token ids, got {prompt!r:.60}")
    if len(prompt) == 0:
        raise ValueError(f"prompt {i} is empty")
    if all(type(t) is int for t in prompt) and 0 <= min(prompt) and max(prompt) < vocab:
        return list(prompt)  # the common case, in builtins; anything else is checked token by token below
    for j, t in enumerate(prompt):
        if not _is_integer(t) or not 0 <= int(t) < vocab:
            raise ValueError(f"prompt {i}: token {t!r} at position {j} is not an id in [0, {vocab})")
    return [int(t) for t in prompt]


def _per_prompt(value: object, n: int, what: str) -> list[int]:
    if _is_integer(value):
        return [_as_id(value, what)] * n
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be an integer or one integer per prompt, got {value!r}")
    if len(value) != n:
        raise ValueError(f"{what} has {len(value)} values for {n} prompts")
    return [_as_id(v, f"{what}[{i}]") for i, v in enumerate(value)]
