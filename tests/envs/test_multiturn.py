"""Guess-the-number: the multi-turn protocol, rewards, transcripts."""

import pytest

from trace_lightning.envs import GuessNumberEnv, MultiTurnEnv, Problem, run_episode

ENV = GuessNumberEnv(low=1, high=15, max_turns=5)


def _problem(secret: int) -> Problem:
    return Problem("guess 1-15:\n", str(secret), {"secret": secret})


def test_bisection_solves_every_secret_in_four_turns() -> None:
    assert isinstance(ENV, MultiTurnEnv)
    for secret in range(1, 16):
        p = _problem(secret)
        turns = iter(ENV.bisection_turns(p))
        episode = run_episode(ENV, p, lambda _ctx, t=turns: next(t))
        assert episode.done and episode.reward == 1.0 and len(episode.turns) <= 4
        assert ENV.score(p, ENV.demonstration(p)) == 1.0


def test_demonstration_transcript_for_seven() -> None:
    assert ENV.demonstration(_problem(7)) == "8 lower\n4 higher\n6 higher\n7 correct\n"


def test_step_feedback_and_budget() -> None:
    state = ENV.reset(_problem(7))
    assert ENV.step(state, "3") == (" higher\n", 0.0, False)
    assert ENV.step(state, "12\n") == (" lower\n", 0.0, False)
    assert ENV.step(state, "seven") == (" invalid\n", 0.0, False)
    assert ENV.step(state, "1") == (" higher\n", 0.0, False)
    assert ENV.step(state, "2") == (" higher\n", 0.0, True)  # fifth turn: out of guesses
    with pytest.raises(ValueError, match="finished"):
        ENV.step(state, "7")


def test_context_grows_with_turns_and_observations() -> None:
    contexts: list[str] = []

    def policy(ctx: str) -> str:
        contexts.append(ctx)
        return "1"

    episode = run_episode(ENV, _problem(2), policy)
    assert episode.reward == 0.0 and len(episode.turns) == 5
    assert contexts[1] == "guess 1-15:\n1 higher\n"
    assert len(contexts[-1]) + len(episode.turns[-1] + episode.observations[-1]) <= 128


def test_score_replays_transcript_and_sampling_is_seeded() -> None:
    assert ENV.score(_problem(7), "8\n4\n7\n") == 1.0
    assert ENV.score(_problem(7), "8\n4\n6\n5\n3\n7\n") == 0.0  # the sixth guess is past the five-turn budget
    assert [p.answer for p in ENV.sample(8, seed=1)] == [p.answer for p in ENV.sample(8, seed=1)]
    assert all(1 <= int(p.answer) <= 15 for p in ENV.sample(50, seed=2))
