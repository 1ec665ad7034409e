"""The model: grouped experts vs the reference loop, the hook protocol, routing replay, KV cache, padding."""

from collections import Counter

import pytest
import torch
from torch import Tensor

from trace_lightning.model import SITES, WEIGHTS, MoEConfig, QuantHook, Transformer
from trace_lightning.model.model import Experts, _use_grouped_mm

B, T = 2, 12


def make_model(name: str = "debug-moe", seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(MoEConfig.from_name(name, **overrides)).eval()


def tokens(vocab: int = 128, seed: int = 1, shape: tuple[int, int] = (B, T)) -> Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


SHARED = {"n_shared_experts": 1, "shared_intermediate": 96, "shared_expert_gate": True, "qkv_bias": True,
          "qk_norm": "none"}


class Recorder(QuantHook):
    """Records every call; optionally rounds to a coarse grid so the hook visibly changes the output."""

    def __init__(self, scale: float = 0.0) -> None:
        self.acts: list[tuple[int, str, tuple[int, ...]]] = []
        self.weights: list[tuple[int, str, tuple[int, ...]]] = []
        self.scale = scale

    def _round(self, x: Tensor) -> Tensor:
        return x if not self.scale else x + ((x / self.scale).round() * self.scale - x).detach()

    def activation(self, x: Tensor, *, layer: int, site: str) -> Tensor:
        self.acts.append((layer, site, tuple(x.shape)))
        return self._round(x)

    def weight(self, w: Tensor, *, layer: int, name: str) -> Tensor:
        self.weights.append((layer, name, tuple(w.shape)))
        return self._round(w)


# ---- experts -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_grouped_mm", [True, False])
@pytest.mark.parametrize("hook", [None, Recorder(scale=0.05)])
def test_grouped_experts_match_reference_loop(use_grouped_mm: bool, hook: QuantHook | None) -> None:
    torch.manual_seed(0)
    config = MoEConfig.from_name("debug-moe", n_experts=16, top_k=4)
    experts = Experts(config, layer=0)
    with torch.no_grad():
        experts.w13.normal_(0, 0.1)
        experts.w2.normal_(0, 0.1)
    experts.use_grouped_mm = use_grouped_mm
    x = torch.randn(3, 7, config.dim, requires_grad=True)
    ids = torch.rand(3, 7, 16).argsort(-1)[..., :4]  # distinct experts per token, some experts untouched
    ids[0, 0] = torch.tensor([5, 5 + 1, 5 + 2, 5 + 3])
    gates = torch.rand(3, 7, 4, requires_grad=True)

    assert _use_grouped_mm(x, experts.w13)  # the torch._grouped_mm path really runs on CPU
    y = experts(x, ids, gates, hook)
    y_ref = experts.forward_reference(x, ids, gates, hook)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(y.pow(2).sum(), [x, gates, experts.w13, experts.w2])
    grads_ref = torch.autograd.grad(y_ref.pow(2).sum(), [x, gates, experts.w13, experts.w2])
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)
    experts(x, ids, gates, hook).sum().backward()  # a stride-0 upstream gradient must not reach _grouped_mm
    assert experts.w13.grad.isfinite().all()


def test_moe_down_rows_are_in_canonical_token_slot_order() -> None:
    """Row (b, t, k) of the moe_down site must be the pair of token (b, t) with its k-th expert."""
    torch.manual_seed(0)
    config = MoEConfig.from_name("debug-moe")
    experts = Experts(config, layer=0)
    with torch.no_grad():
        experts.w13.normal_(0, 0.1)
    x = torch.randn(2, 5, config.dim)
    ids = torch.rand(2, 5, 8).argsort(-1)[..., :2]
    seen = {}

    class Capture(QuantHook):
        def activation(self, h: Tensor, *, layer: int, site: str) -> Tensor:
            seen[site] = h
            return h

    experts(x, ids, torch.ones(2, 5, 2), Capture())
    b, t, k = 1, 3, 1
    gate, up = torch.nn.functional.linear(x[b, t], experts.w13[ids[b, t, k]]).chunk(2)
    torch.testing.assert_close(seen["moe_down"][b, t, k], torch.nn.functional.silu(gate) * up)


# ---- hook protocol -------------------------------------------------------------------------------------------

def expected_sites(c: MoEConfig, shared: bool) -> dict[str, tuple[int, ...]]:
    sites = {"attn_in": (B, T, c.dim), "k": (B, T, c.n_kv_heads, c.head_dim), "v": (B, T, c.n_kv_heads, c.head_dim),
             "attn_out": (B, T, c.q_dim), "moe_in": (B, T, c.dim), "moe_down": (B, T, c.top_k, c.moe_intermediate)}
    if shared:
        sites["shared_down"] = (B, T, c.shared_intermediate)
    return sites


def expected_weights(c: MoEConfig, shared: bool) -> dict[str, tuple[int, ...]]:
    E, I, D = c.n_experts, c.moe_intermediate, c.dim
    weights = {"attn.wqkv": (c.q_dim + 2 * c.kv_dim, D), "attn.wo": (D, c.q_dim), "moe.w13": (E, 2 * I, D),
               "moe.w2": (E, D, I)}
    if shared:
        weights |= {"moe.shared_w13": (2 * c.shared_intermediate, D), "moe.shared_w2": (D, c.shared_intermediate)}
    return weights


@pytest.mark.parametrize("shared", [False, True])
def test_hook_sees_every_site_once_with_documented_shapes(shared: bool) -> None:
    model = make_model(bf16_first_layers=1, bf16_last_layers=1, **(SHARED if shared else {}))
    c, hook = model.config, Recorder()
    model(tokens(), hook=hook)
    sites, weights = expected_sites(c, shared), expected_weights(c, shared)
    assert set(sites) <= set(SITES) and set(weights) <= set(WEIGHTS)
    assert {layer for layer, _, _ in hook.acts + hook.weights} == {1, 2}  # boundary layers 0 and 3 skipped
    for layer in (1, 2):
        acts = [(s, shape) for i, s, shape in hook.acts if i == layer]
        assert Counter(s for s, _ in acts) == Counter(sites.keys())  # each site exactly once
        assert dict(acts) == sites
        assert dict((n, shape) for i, n, shape in hook.weights if i == layer) == weights


def test_identity_hook_is_exact_and_a_rounding_hook_changes_logits() -> None:
    model, x = make_model(), tokens()
    plain = model(x)
    assert torch.equal(model(x, hook=QuantHook()), plain)
    assert (model(x, hook=Recorder(scale=0.05)) - plain).abs().max() > 1e-3


def test_kv_hook_output_is_what_the_cache_stores() -> None:
    model, x = make_model(), tokens()

    class Double(QuantHook):
        def activation(self, t: Tensor, *, layer: int, site: str) -> Tensor:
            return 2 * t if site in ("k", "v") else t

    seen: dict[tuple[int, str], Tensor] = {}

    class Capture(QuantHook):
        def activation(self, t: Tensor, *, layer: int, site: str) -> Tensor:
            seen[layer, site] = t
            return t

    model(x, hook=Capture())
    cache = ConcatCache(model.config.n_layers)
    model(x, hook=Double(), cache=cache)
    assert torch.equal(cache.v[0], 2 * seen[0, "v"])  # layer 0 input is the same with or without the hook


# ---- routing replay ------------------------------------------------------------------------------------------

def test_replaying_own_routes_is_exact_and_other_routes_change_logits() -> None:
    model, x = make_model(), tokens()
    out = model(x, return_routes=True)
    assert len(out.routes) == 4 and out.routes[0].shape == (B, T, 2) and out.routes[0].dtype == torch.int64
    replay = model(x, routed=out.routes, return_routes=True)
    assert torch.equal(replay.logits, out.logits)
    assert all(torch.equal(a, b) for a, b in zip(replay.routes, out.routes, strict=True))
    other = [(r + 1) % model.config.n_experts for r in out.routes]
    assert (model(x, routed=other) - out.logits).abs().max() > 1e-3


def test_replay_gradients_reach_the_router_and_match_free_routing() -> None:
    model, x = make_model(), tokens()
    out = model(x, return_routes=True)
    loss = out.logits.log_softmax(-1).mean()
    free = torch.autograd.grad(loss, [b.moe.router.weight for b in model.layers])
    replay_loss = model(x, routed=[r.clone() for r in out.routes]).log_softmax(-1).mean()
    replayed = torch.autograd.grad(replay_loss, [b.moe.router.weight for b in model.layers])
    for g_free, g_replay in zip(free, replayed, strict=True):
        assert g_replay.abs().sum() > 0
        torch.testing.assert_close(g_replay, g_free)


def test_replayed_gates_are_router_probabilities_at_the_given_ids() -> None:
    model = make_model(norm_topk_prob=False)
    gen = torch.Generator().manual_seed(5)
    router, x = model.layers[0].moe.router, torch.randn(B, T, 128, generator=gen)
    ids = torch.randint(0, 8, (B, T, 2), generator=gen)
    gates, got = router(x, ids)
    probs = torch.nn.functional.linear(x, router.weight).float().softmax(-1)
    assert torch.equal(got, ids)
    torch.testing.assert_close(gates, probs.gather(-1, ids))


def test_routed_must_cover_every_layer_with_the_right_shape() -> None:
    model, x = make_model(), tokens()
    routes = model(x, return_routes=True).routes
    with pytest.raises(ValueError, match="routed has 3 layers"):
        model(x, routed=routes[:3])
    with pytest.raises(ValueError, match="routed ids have shape"):
        model(x, routed=[r[..., :1] for r in routes])


# ---- KV cache, padding, dtype --------------------------------------------------------------------------------

class ConcatCache:
    """The smallest KVCacheProtocol: concatenate along time, attend to keys at earlier or equal positions."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers
        self.v: list[Tensor | None] = [None] * n_layers
        self.pos: list[Tensor | None] = [None] * n_layers

    def update(self, layer: int, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k], 1), torch.cat([self.v[layer], v], 1)
            positions_all = torch.cat([self.pos[layer], positions], 1)
        else:
            positions_all = positions
        self.k[layer], self.v[layer], self.pos[layer] = k, v, positions_all
        return k, v, positions_all[:, None, :] <= positions[:, :, None]  # (B, T, S)


def test_prefill_then_decode_equals_full_forward() -> None:
    model, x = make_model(), tokens()
    full = model(x, return_routes=True)
    cache, prefill = ConcatCache(model.config.n_layers), 5
    pos = torch.arange(T).expand(B, T)
    step_logits = [model(x[:, :prefill], positions=pos[:, :prefill], cache=cache)]
    for t in range(prefill, T):
        step_logits.append(model(x[:, t : t + 1], positions=pos[:, t : t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(step_logits, 1), full.logits, rtol=1e-5, atol=1e-5)


def test_right_padding_matches_unpadded_rows() -> None:
    model, x = make_model(), tokens()
    lengths = [T, 7]
    mask = torch.arange(T)[None] < torch.tensor(lengths)[:, None]  # (B, T)
    padded = model(x, attention_mask=mask)
    assert padded.isfinite().all()
    for b, n in enumerate(lengths):
        torch.testing.assert_close(padded[b, :n], model(x[b : b + 1, :n])[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cache"):
        model(x, attention_mask=mask, cache=ConcatCache(4))


def test_bf16_forward_tracks_fp32() -> None:
    model, x = make_model(), tokens()
    ref = model(x).softmax(-1)
    probs = model.to(torch.bfloat16)(x)
    assert probs.dtype == torch.bfloat16
    assert (probs.float().softmax(-1) - ref).abs().max() < 0.02


def test_init_is_deterministic_from_torch_rng() -> None:
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.layers[0].moe.experts.w13, c.layers[0].moe.experts.w13)
    assert a.layers[0].attention_norm.weight.eq(1).all()
    assert a.layers[0].moe.experts.w13.std().item() == pytest.approx(0.02, rel=0.05)


def test_tied_embeddings_share_one_matrix() -> None:
    model = make_model(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


def test_logits_at_gives_each_rows_logits_at_one_position() -> None:
    """What a prefill asks for: the logits of each row's last prompt token, without the (B, T, V) tensor."""
    model, x = make_model(), tokens()
    full = model(x, return_routes=True)
    at = torch.tensor([T - 1, 3])
    picked = model(x, logits_at=at, return_routes=True)
    assert picked.logits.shape == (B, 1, model.config.vocab_size)
    torch.testing.assert_close(picked.logits[:, 0], full.logits[torch.arange(B), at], rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(picked.routes, full.routes, strict=True))  # every position routed
