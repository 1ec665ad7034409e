"""The engine's memory plan equals what a generate call really allocates, and max_batch is the largest that fits."""

from __future__ import annotations

import copy

import pytest
import torch

from trace_lightning.model import Transformer
from trace_lightning.rollout import CaptureSpec, Engine, FP4Precision, SamplingParams, memory
from trace_lightning.rollout.capture import Recorder

from .conftest import PROMPTS


def _allocated(engine: Engine, capture: CaptureSpec | None, batch: int, max_len: int) -> tuple[int, int, int]:
    """(KV cache, record buffer, route) bytes after a real prefill of `batch` prompts into `max_len` slots."""
    c = engine.config
    recorder = Recorder(engine.record_layout(capture), batch, max_len, c.n_layers, c.top_k, c.n_experts, engine.device)
    cache = engine._cache(batch, max_len, recorder if capture else None)
    with torch.inference_mode():
        engine.prefill(PROMPTS[:batch], cache, engine._hook(recorder if capture else None), recorder)
    assert recorder.observed == set(recorder.slots)  # every laid-out site was written by the prefill
    return cache.nbytes(), recorder.data.nbytes, recorder.routes.nbytes


@pytest.mark.parametrize("precision", ["bf16", FP4Precision(), FP4Precision(kv=False), FP4Precision(fmt="mxfp4")],
                         ids=["bf16", "fp4", "fp4-dense-kv", "mxfp4"])
def test_memory_plan_is_what_generate_allocates(model: Transformer, precision: object) -> None:
    engine = Engine(copy.deepcopy(model), precision, backend="sim", cuda_graph=False)
    fp4 = precision != "bf16"
    capture = CaptureSpec(layers="all") if fp4 else None
    batch, max_len = len(PROMPTS), 24
    plan = engine.memory_plan(batch, max_len, capture)
    kv, records, routes = _allocated(engine, capture, batch, max_len)
    assert (plan.kv_cache, plan.records, plan.routes) == (kv, records, routes)
    dense = sum(p.nbytes for p in engine.model.parameters())
    assert plan.weights >= dense and (plan.weights > dense) == fp4  # FP4 modules hold codes beside the parameters


def test_max_batch_is_the_largest_plan_within_the_budget(model: Transformer) -> None:
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False)
    capture, budget, reserve = CaptureSpec(layers="all"), 50 * 2**20, 4 * 2**20
    n = engine.max_batch(512, budget, capture=capture, reserve_bytes=reserve)
    assert n > 0
    assert engine.memory_plan(n, 512, capture).total + reserve <= budget
    assert engine.memory_plan(n + 1, 512, capture).total + reserve > budget
    assert engine.max_batch(512, budget) > n  # without records more fits
    assert engine.max_batch(512, engine.weight_bytes()) == 0


def test_a_continuous_plan_counts_slot_rows_of_cache_and_sequence_rows_of_record(model: Transformer) -> None:
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False)
    capture, max_len = CaptureSpec(mode="parity"), 24
    static = engine.memory_plan(8, max_len, capture)
    slots = engine.memory_plan(8, max_len, capture, max_batch=2)
    two_rows = engine._cache(2, max_len, None).nbytes()  # what generate allocates: 2 slots, and a refill's staging
    assert slots.kv_cache == slots.refill_cache == two_rows and static.refill_cache == 0
    assert (slots.records, slots.routes) == (static.records, static.routes)  # one row per sequence either way
    assert engine.memory_plan(8, max_len, capture, max_batch=8) == static


def test_a_streamed_record_costs_the_device_its_ring_only(model: Transformer) -> None:
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False, sync_every=4)
    kept = engine.memory_plan(4, 64, CaptureSpec(mode="parity"))
    streamed = engine.memory_plan(4, 64, CaptureSpec(mode="parity", stream_to_host=True), prompt_len=9)
    c = engine.config
    recorder = Recorder(engine.record_layout(CaptureSpec(mode="parity")), 4, 64, c.n_layers, c.top_k, c.n_experts,
                        engine.device, ring=16)  # max(prompt 9, RING_CHECKS x sync_every = 16)
    assert streamed.records == recorder.ring.nbytes + recorder.ring_pos.nbytes + recorder.ring_row.nbytes
    assert streamed.host_records == kept.records == recorder.data.nbytes and kept.host_records == 0
    assert streamed.records < kept.records / 3  # 16 ring columns instead of 64 positions


# ---- the measured workspace ------------------------------------------------------------------------------------
def test_live_bytes_counts_what_a_block_allocates_and_holds_at_once() -> None:
    """3 MiB at the peak: 1 + 2 MiB held together; a view adds nothing, and neither does storage from before the
    block (a view or a product of a weight counts only as the new tensor it makes)."""
    weight = torch.ones(256, 256)

    def block() -> torch.Tensor:
        a = torch.empty(1 << 20, dtype=torch.uint8)
        b = torch.empty(2 << 20, dtype=torch.uint8)
        kept, _ = b[:16], weight.t()
        del a, b
        torch.empty(1 << 20, dtype=torch.uint8)
        return kept

    assert memory.peak_transient_bytes(block, torch.device("cpu")) == 3 << 20
    assert memory.peak_transient_bytes(lambda: weight @ weight, torch.device("cpu")) == weight.nbytes


@pytest.mark.parametrize(("precision", "capture"), [("bf16", None), (FP4Precision(), CaptureSpec(mode="parity"))],
                         ids=["bf16", "fp4-parity"])
def test_workspace_is_a_forwards_measured_transient_memory(model: Transformer, precision: object,
                                                          capture: CaptureSpec | None) -> None:
    """Past its probe rows the extrapolated workspace is what a forward of that many rows measures (to the bytes of
    a row's rounding), below them an upper bound; a plan with it counts the prefill's or a decode step's, whichever is
    larger, and prefill chunks shrink it."""
    engine = Engine(copy.deepcopy(model), precision, backend="sim", cuda_graph=False)
    for rows, tokens in ((40, 16), (3, 16), (600, 1)):
        measured = engine._measure_forward(rows, tokens, capture)
        planned = engine.workspace_bytes(rows, tokens, capture)
        assert planned >= measured > 0
        if rows * tokens >= 512:
            assert planned - measured <= rows  # the per-row slope is floored to whole bytes
    plan = engine.memory_plan(40, 24, capture, prompt_len=16, workspace=True)
    assert plan.workspace == max(engine.workspace_bytes(40, 16, capture), engine.workspace_bytes(40, 1, capture))
    assert plan.total == engine.memory_plan(40, 24, capture).total + plan.workspace
    chunked = Engine(copy.deepcopy(model), precision, backend="sim", cuda_graph=False, prefill_chunk=4)
    assert chunked.memory_plan(40, 24, capture, prompt_len=16, workspace=True).workspace < plan.workspace


def test_max_batch_with_the_workspace_is_the_largest_plan_within_the_budget(model: Transformer) -> None:
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False)
    capture, budget, reserve = CaptureSpec(mode="parity"), 40 * 2**20, 2**20
    n = engine.max_batch(128, budget, capture=capture, reserve_bytes=reserve, prompt_len=64, workspace=True)
    assert 0 < n < engine.max_batch(128, budget, capture=capture, reserve_bytes=reserve)
    plan = engine.memory_plan(n, 128, capture, prompt_len=64, workspace=True)
    assert plan.total + reserve <= budget
    assert engine.memory_plan(n + 1, 128, capture, prompt_len=64, workspace=True).total + reserve > budget


def test_the_dense_prefill_paths_workspace_is_planned(model: Transformer) -> None:
    """A forward past prefill_dense_from dequantizes weights for dense GEMMs: its workspace has its own line, probed
    on forwards that take that path. The FP4 kernels' line (probed at 16 and 32 rows of 16 positions, under the
    threshold) misplans it (on the sim, whose FP4 path dequantizes too, it over-counts; on a GPU it would under-count
    the dense path's dequantized weights)."""
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False, prefill_dense_from=2048)
    capture, rows, tokens = CaptureSpec(mode="parity"), 160, 16  # 2,560 positions: the dense path
    measured = engine._measure_forward(rows, tokens, capture)
    r, at_r, per_row = engine._workspace_line(tokens, capture)
    assert abs(at_r + per_row * (rows - r) - measured) > rows  # the kernels' line alone is off by more than rounding
    assert measured <= engine.workspace_bytes(rows, tokens, capture) <= measured + rows
    below = engine.workspace_bytes(100, tokens, capture)  # 1,600 positions: the FP4 kernels
    assert below == at_r + per_row * (100 - r)
    budget, reserve = engine.weight_bytes() + 3 * measured, 2**20
    n = engine.max_batch(24, budget, capture=capture, reserve_bytes=reserve, prompt_len=tokens, workspace=True)
    assert engine.memory_plan(n, 24, capture, prompt_len=tokens, workspace=True).total + reserve <= budget
    assert engine.memory_plan(n + 1, 24, capture, prompt_len=tokens, workspace=True).total + reserve > budget


@pytest.mark.parametrize("capture", [None, CaptureSpec(mode="parity")], ids=["fp4", "fp4-records"])
def test_a_generate_calls_peak_on_the_sim_is_its_plan(model: Transformer, capture: CaptureSpec | None) -> None:
    """The CPU's stand-in for the CUDA test below: a call's live bytes at their peak (LiveBytes) against its plan with
    the measured workspace, at a context where the sim's attention (the cache's window dequantized, a layer at a
    time) is the largest transient. Probed over a cache one position long, the plan was 0.85x the peak here (0.47x at
    32 x 172 positions of debug-moe's four layers)."""
    engine = Engine(model, FP4Precision(), backend="sim", cuda_graph=False)
    prompts, params = [p * 3 for p in PROMPTS] * 4, SamplingParams(max_new_tokens=120, temperature=1.0, seed=1,
                                                                   stop_token_ids=[])
    engine.generate(prompts, params, capture=capture)  # what a first call allocates once
    with memory.LiveBytes() as live:
        out = engine.generate(prompts, params, capture=capture)
    prompt_len = max(len(p) for p in prompts)
    plan = engine.memory_plan(len(prompts), prompt_len + 120, capture, prompt_len=prompt_len, workspace=True)
    assert len(out.responses) == len(prompts)
    assert 0.95 * (plan.total - plan.weights) <= live.peak <= plan.total - plan.weights


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "keep"), [("bf16", False), (FP4Precision(compute_dtype="bf16"), False),
                                                 (FP4Precision(compute_dtype="bf16"), True)],
                         ids=["bf16", "fp4", "fp4-kept-session"])
def test_a_generate_calls_peak_is_within_its_plan_on_cuda(base_model: Transformer, precision: object,
                                                          keep: bool) -> None:
    """issue 24's memory target on the real allocator: a call's peak above the memory held before it is at most 1.15x
    its plan (less the weights, which are held already) plus a fixed 64 MiB; with a kept decode session too (its
    buffers allocated by the measured call, the record handed over as a copy)."""
    engine = Engine(copy.deepcopy(base_model).to("cuda"), precision, keep_decode_graph=keep)
    capture = CaptureSpec(mode="parity") if isinstance(precision, FP4Precision) else None
    prompts, params = [p * 8 for p in PROMPTS], SamplingParams(max_new_tokens=32, temperature=1.0, seed=1)
    engine.generate(prompts, params, capture=capture)  # compile, autotune
    engine.release_decode_session()  # the measured call allocates its own
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = engine.generate(prompts, params, capture=capture)
    peak = torch.cuda.max_memory_allocated() - base
    max_len = max(len(p) for p in prompts) + 32
    plan = engine.memory_plan(len(prompts), max_len, capture, prompt_len=max(len(p) for p in prompts), workspace=True)
    assert out.responses and 0 < peak <= 1.15 * (plan.total - plan.weights) + (64 << 20)


def test_a_kept_session_plans_its_rounded_buffers_and_the_record_it_hands_over(model: Transformer) -> None:
    """Where decode sessions are kept (CUDA graphs), the buffers are GRAPH_LENGTH_STEP-rounded and the record comes
    out as a copy: the plan counts both, as the call allocates them (the H100's peak was 2x the records' plan)."""
    engine = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False)
    engine._keeps_decode_graphs = lambda: True  # as on CUDA with graphs: the session stays for the next call
    capture, params = CaptureSpec(mode="parity"), SamplingParams(max_new_tokens=6, stop_token_ids=[])
    batch, max_len = len(PROMPTS), max(len(p) for p in PROMPTS) + 6
    out = engine.generate(PROMPTS, params, capture=capture)
    session = engine._session
    assert session is not None and session.recorder.max_len == 64 > max_len  # rounded up
    plan = engine.memory_plan(batch, max_len, capture)
    assert plan.kv_cache == session.cache.nbytes()
    assert (plan.records, plan.routes) == (session.recorder.data.nbytes, session.recorder.routes.nbytes)
    assert out.record is not None and out.record.data.data_ptr() != session.recorder.data.data_ptr()  # a copy
    assert plan.handover == out.record.data.nbytes + out.route_table.nbytes
    unkept = Engine(copy.deepcopy(model), FP4Precision(), backend="sim", cuda_graph=False)
    assert plan.total > unkept.memory_plan(batch, max_len, capture).total + out.record.data.nbytes
    streamed = engine.memory_plan(batch, max_len, CaptureSpec(mode="parity", stream_to_host=True))
    assert streamed.handover == out.route_table.nbytes  # a streamed record is never kept, so never copied
