"""Triton fp4_moe against the sim: outputs within float32-accumulation tolerance, moe_down record near-identical."""

import pytest
import torch

from trace_lightning import kernels, sim
from trace_lightning.kernels import moe as moe_kernels
from trace_lightning.kernels.moe import align_pairs
from trace_lightning.sim.testing import quantize_weight, random_routing

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def problem(N: int, D: int, I: int, E: int, k: int, device: str, seed: int):  # noqa: ANN201
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=gen).to(device)
    w13 = quantize_weight(torch.randn(E, 2 * I, D, generator=gen).to(device) / 8)
    w2 = quantize_weight(torch.randn(E, D, I, generator=gen).to(device) / 8)
    ids, weights = random_routing(N, k, E, gen)
    return x, w13, w2, ids.to(device), weights.to(device)


def test_align_pairs_groups_by_expert(device: str) -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=device)
    sorted_ids, block_expert, blocks = align_pairs(ids, 4, 2)
    tiles = sorted_ids.view(blocks, 2).cpu()
    flat = ids.reshape(-1).cpu()
    seen = []
    for tile, e in zip(tiles, block_expert.cpu(), strict=True):
        pairs = [int(p) for p in tile if p < flat.numel()]
        assert all(int(flat[p]) == int(e) for p in pairs)
        seen += pairs
    assert sorted(seen) == list(range(6))


def reference_alignment(flat: torch.Tensor, experts: int, block_m: int, blocks: int) -> tuple[list, list]:
    """Stable sort by expert, each expert's run padded to block_m (padding id = P), tile owners."""
    P = flat.numel()
    slots, owners = [], []
    for e in range(experts):
        pairs = [p for p in range(P) if int(flat[p]) == e]
        if not pairs:
            continue
        run = pairs + [P] * (-len(pairs) % block_m)
        slots += run
        owners += [e] * (len(run) // block_m)
    return slots + [P] * (blocks * block_m - len(slots)), owners + [experts] * (blocks - len(owners))


def test_align_pairs_with_no_pairs(device: str) -> None:
    sorted_ids, block_expert, blocks = align_pairs(torch.zeros(0, 8, dtype=torch.int64, device=device), 128, 16)
    assert blocks == 0 and sorted_ids.numel() == 0 and block_expert.numel() == 0


def _runs(slots: list, owners: list, block_m: int, P: int) -> list:
    """Per tile: (its expert, the sorted real pair ids in it), padding dropped."""
    return [(owner, sorted(p for p in slots[i * block_m:(i + 1) * block_m] if p < P)) for i, owner in enumerate(owners)]


def assert_grouped_like(sorted_ids: torch.Tensor, block_expert: torch.Tensor, blocks: int, ids: torch.Tensor,
                        experts: int, block_m: int) -> None:
    """The tiles and padding of the stable padded sort, each expert's pairs in some order (the cursors' arrival
    order on a GPU): an expert with more than block_m pairs may spread them differently over its tiles, so the tiles
    of one expert are compared together."""
    slots, owners = reference_alignment(ids.reshape(-1), experts, block_m, blocks)
    assert block_expert.cpu().tolist() == owners
    P = ids.numel()
    got = sorted_ids.cpu().tolist()

    def by_expert(s: list) -> dict:
        out: dict = {}
        for owner, pairs in _runs(s, owners, block_m, P):
            out.setdefault(owner, []).extend(pairs)
        return {e: sorted(p) for e, p in out.items()}

    assert by_expert(got) == by_expert(slots)
    assert [p >= P for p in got] == [p >= P for p in slots]  # padding in the same slots


@pytest.mark.parametrize(("tokens", "k", "experts", "block_m"), [(3, 2, 4, 2), (64, 8, 128, 16), (50, 6, 60, 16),
                                                                 (300, 2, 8, 64), (1, 8, 128, 16), (37, 8, 64, 16)])
def test_align_pairs_by_atomic_cursors(device: str, tokens: int, k: int, experts: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(tokens * experts + k)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    assert_grouped_like(*align_pairs(ids.to(device), experts, block_m), ids, experts, block_m)


def test_align_pairs_in_chunks(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More pairs than one placement chunk and more tiles than one store chunk: the cursors and the tile labels
    carry over."""
    monkeypatch.setattr(moe_kernels, "ALIGN_CHUNK", 64)
    monkeypatch.setattr(moe_kernels, "ALIGN_SLOTS", 32)
    gen = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(24, generator=gen)[:3] for _ in range(150)])
    sorted_ids, block_expert, blocks = align_pairs(ids.to(device), 24, 4)
    assert blocks > 32
    assert_grouped_like(sorted_ids, block_expert, blocks, ids, 24, 4)


def test_fp4_moe_does_not_depend_on_the_order_within_an_expert(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What lets the alignment place pairs by atomics: with every expert's pairs reversed in their tiles, fp4_moe's
    output and moe_down record are bit-identical."""
    x, w13, w2, ids, weights = problem(40, 64, 48, 4, 3, device, seed=11)
    out, q = kernels.fp4_moe(x, w13, w2, ids, weights)
    original = moe_kernels.align_pairs

    def reversed_runs(topk_ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        sorted_ids, block_expert, blocks = original(topk_ids, experts, block_m)
        P, slots, owners = topk_ids.numel(), sorted_ids.tolist(), block_expert.tolist()
        i = 0
        while i < blocks and owners[i] < experts:  # an expert's run: its consecutive tiles
            j = i
            while j < blocks and owners[j] == owners[i]:
                j += 1
            real = [p for p in slots[i * block_m:j * block_m] if p < P]
            slots[i * block_m:i * block_m + len(real)] = real[::-1]
            i = j
        return torch.tensor(slots, dtype=sorted_ids.dtype, device=sorted_ids.device), block_expert, blocks

    monkeypatch.setattr(moe_kernels, "align_pairs", reversed_runs)
    out_rev, q_rev = kernels.fp4_moe(x, w13, w2, ids, weights)
    assert torch.equal(out, out_rev)
    assert torch.equal(q.packed, q_rev.packed) and torch.equal(q.scale_bytes(), q_rev.scale_bytes())
    assert torch.equal(q.global_scale, q_rev.global_scale)  # the row globals: where a dot's rounding shows first


E2M1_GAPS = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0])  # magnitude index -> gap to the one below


def assert_moe_down_records_agree(q, q_ref) -> None:  # noqa: ANN001
    """The kernel's h differs from the sim's in the last float32 ulps (another summation order), so a code may
    move, rarely, to the neighbouring magnitude across a rounding boundary: never farther, never its sign. At most
    1% such moves (none measured under the interpreter on any shape here); the values then agree to one E2M1 gap
    at that block's scale, and elsewhere to the few ulps by which the row global scales differ."""
    assert q.shape == q_ref.shape
    codes, ref_codes = q.codes().cpu().long(), q_ref.codes().cpu().long()
    moved = codes != ref_codes
    assert moved.float().mean() <= 0.01
    step = (codes & 7) - (ref_codes & 7)
    assert ((step.abs() == 1) & ((codes >> 3) == (ref_codes >> 3)))[moved].all(), "a code moved past a neighbour"
    multiplier = q_ref.block_multiplier().cpu().repeat_interleave(q_ref.block_size, -1)
    gap = E2M1_GAPS[torch.maximum(codes & 7, ref_codes & 7)] * multiplier
    got, want = q.dequantize().cpu(), q_ref.dequantize().cpu()
    torch.testing.assert_close(got[~moved], want[~moved], rtol=2.0**-20, atol=0)
    assert ((got - want).abs()[moved] <= gap[moved] * (1 + 2.0**-20)).all()


@pytest.mark.parametrize("quantize_h", [True, False])
@pytest.mark.parametrize("shape", [(9, 64, 48, 6, 2), (40, 32, 32, 4, 3), (12, 256, 128, 4, 2)])  # last: K tiles even
def test_fp4_moe_matches_sim(device: str, quantize_h: bool, shape: tuple[int, ...]) -> None:
    x, w13, w2, ids, weights = problem(*shape, device, seed=sum(shape))
    out, q = kernels.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=quantize_h)
    ref, q_ref = sim.fp4_moe(x, w13, w2, ids, weights, quantize_intermediate=quantize_h)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    if quantize_h:
        assert_moe_down_records_agree(q, q_ref)
    else:
        assert q is None


def test_fp4_moe_bf16_and_untouched_experts(device: str) -> None:
    x, w13, w2, ids, weights = problem(6, 64, 32, 8, 2, device, seed=3)
    ids = torch.tensor([[0, 3], [3, 0], [0, 3], [3, 0], [0, 3], [3, 0]], device=device)
    w13.scales.view(torch.uint8)[5] = 0x7F  # NaN scales on an expert nobody picked: must never be read
    w2.scales.view(torch.uint8)[6] = 0x7F
    out, _ = kernels.fp4_moe(x.bfloat16(), w13, w2, ids, weights.bfloat16())
    ref, _ = sim.fp4_moe(x.bfloat16(), w13, w2, ids, weights.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.float().abs().max().item())


def test_backends_expose_the_same_ops() -> None:
    import inspect

    names = ("quantize_nvfp4", "quantize_nvfp4_rows", "fake_quantize_nvfp4_rows", "quantize_mxfp4", "pack_parity",
             "fp4_linear", "fp4_moe", "kv_append", "fp4_kv_attention", "prepare_weight", "prepared_weight",
             "prefers_word_layout", "prefers_value_tiles", "write_record_slot")

    def positional(fn: object) -> list[str]:  # a backend's own options (sim numerics, kernel layouts): keyword-only
        params = inspect.signature(fn).parameters.values()
        return [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]

    for name in names:
        assert positional(getattr(sim, name)) == positional(getattr(kernels, name)), name


class LaunchSpy:
    """A kernel whose launches are recorded as (grid, num_warps, num_stages) before they run."""

    def __init__(self, kernel) -> None:  # noqa: ANN001 (a triton kernel)
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.launches.append((grid, kwargs.get("num_warps"), kwargs.get("num_stages")))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("launch", [kernels.GemmLaunch(32, 64, 4, 2), kernels.GemmLaunch(64, None, 8, 3)])
def test_fp4_moe_takes_the_launch_shapes_it_is_given(device: str, monkeypatch: pytest.MonkeyPatch,
                                                     launch: kernels.GemmLaunch) -> None:
    """KernelOptions.moe_gate_up / moe_down (what tools/sweep_moe.py varies) reach both GEMMs' launches, and the
    result stays the sim's."""
    spies = {name: LaunchSpy(getattr(moe_kernels, name)[0]) for name in ("_GATE_UP", "_DOWN")}
    for name, spy in spies.items():
        monkeypatch.setattr(moe_kernels, name, (spy, getattr(moe_kernels, name)[1]))
    N, D, I = 9, 128, 96
    x, w13, w2, ids, weights = problem(N, D, I, 6, 2, device, seed=5)
    with kernels.kernel_options(kernels.KernelOptions(moe_gate_up=launch, moe_down=launch)):
        out, q = kernels.fp4_moe(x, w13, w2, ids, weights)
    for spy, n in ((spies["_GATE_UP"], I), (spies["_DOWN"], D)):
        (grid, warps, stages), = spy.launches
        assert (grid[1], warps, stages) == (-(-n // launch.block_n), launch.warps, launch.stages)
    ref, q_ref = sim.fp4_moe(x, w13, w2, ids, weights)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    assert_moe_down_records_agree(q, q_ref)


@pytest.mark.parametrize("tiled", [False, True])
def test_fp4_moe_word_layout_weights_give_identical_results(device: str, tiled: bool) -> None:
    """Weights in the kernels' word layout, and in their tiles (their own PTX decoder on CUDA, converted back to
    stored bits but kept in tiles under the interpreter) give the same bits as the stored order: same codes times
    the same scales, same sums."""
    from trace_lightning.kernels.layout import prepare_weight
    from trace_lightning.quant.words import WordNVFP4

    x, w13, w2, ids, weights = problem(24, 128, 128, 6, 2, device, seed=11)
    x = x.to(torch.bfloat16)
    out, q = kernels.fp4_moe(x, w13, w2, ids, weights)
    out_w, q_w = kernels.fp4_moe(x, WordNVFP4.from_stored(w13, tiled), WordNVFP4.from_stored(w2, tiled), ids, weights)
    assert torch.equal(out_w, out) and torch.equal(q_w.packed, q.packed)
    prepared = prepare_weight(w13, torch.bfloat16)
    assert isinstance(prepared, WordNVFP4) == (device == "cuda")
    assert not isinstance(prepared, WordNVFP4) or prepared.tiled  # [6, 256, 128]: whole tiles
    assert torch.equal(prepared.codes(), w13.codes())
