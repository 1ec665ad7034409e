import torch

from trace_lightning.rollout.sampling import sample, seed_keys, sequence_seeds, truncate, uniform_noise


def test_noise_is_a_function_of_seed_and_step_only() -> None:
    keys = seed_keys(sequence_seeds(7, 3), "cpu")
    batch = uniform_noise(keys, step=4, vocab=50)
    alone = uniform_noise(keys[1:2], step=4, vocab=50)
    assert torch.equal(batch[1:2], alone)
    assert not torch.equal(batch[0], batch[1])
    assert not torch.equal(uniform_noise(keys, step=5, vocab=50), batch)
    assert batch.min() > 0 and batch.max() < 1


def test_noise_is_uniform() -> None:
    u = uniform_noise(seed_keys(sequence_seeds(0, 64), "cpu"), step=0, vocab=4096).flatten()
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert torch.allclose(hist, torch.full_like(hist, 0.1), atol=0.005)
    assert abs(u.mean().item() - 0.5) < 0.002


def test_samples_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    keys = seed_keys(sequence_seeds(1, n), "cpu")
    tokens, logprobs = sample(probs.log().expand(n, 4), keys, step=3, temperature=1.0)
    freq = torch.bincount(tokens, minlength=4) / n
    assert torch.allclose(freq, probs, atol=0.012)
    assert torch.allclose(logprobs, probs.log()[tokens], atol=1e-6)


def test_temperature_scales_logprobs_over_full_vocab() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    keys = seed_keys([5], "cpu")
    token, lp = sample(logits, keys, step=0, temperature=0.5, top_k=2)
    assert token.item() in (0, 1)
    assert torch.allclose(lp, (logits / 0.5).log_softmax(-1)[0, token], atol=1e-6)  # untruncated


def test_greedy_reports_unscaled_logprob() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 4.9]])
    tokens, lp = sample(logits, seed_keys([0, 1], "cpu"), step=0, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(lp, logits.log_softmax(-1)[[0, 1], [1, 0]])


def test_truncation_keeps_top_k_and_nucleus() -> None:
    scaled = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(truncate(scaled, top_k=2, top_p=1.0)).tolist() == [[False, False, True, True]]
    p = scaled.softmax(-1)[0]  # 0.644, 0.237, 0.087, 0.032
    kept = ~torch.isinf(truncate(scaled, top_k=0, top_p=float(p[0] + 0.01)))
    assert kept.tolist() == [[True, True, False, False]]
    assert (~torch.isinf(truncate(scaled, 0, 0.01))).sum() == 1  # the argmax always stays
    n = 4000
    tokens, _ = sample(scaled.expand(n, 4), seed_keys(sequence_seeds(2, n), "cpu"), 0, 1.0, top_p=0.85)
    assert set(tokens.tolist()) == {0, 1}


def test_banned_ids_are_not_sampled_before_their_step_and_logprobs_stay_full() -> None:
    logits = torch.tensor([[0.0, 9.0, 1.0, 0.5]]).expand(64, 4)  # token 1 (the "stop") nearly always wins
    keys = seed_keys(sequence_seeds(3, 64), "cpu")
    banned = torch.tensor([1])
    full = logits.log_softmax(-1)
    for temperature in (1.0, 0.0):
        early, lp = sample(logits, keys, step=2, temperature=temperature, banned=banned, banned_until=3)
        assert 1 not in early.tolist()
        scaled = full if temperature == 0 else (logits / temperature).log_softmax(-1)
        torch.testing.assert_close(lp, scaled.gather(-1, early[:, None]).squeeze(-1), rtol=0, atol=0)
        late, _ = sample(logits, keys, step=3, temperature=temperature, banned=banned, banned_until=3)
        assert (late == 1).float().mean() > 0.99
    per_row = torch.tensor([[0], [5]])  # slots at different steps (continuous batching): only row 0 is early
    tokens, _ = sample(logits[:2], keys[:2], step=per_row, temperature=0.0, banned=banned, banned_until=3)
    assert tokens.tolist() == [2, 1]
