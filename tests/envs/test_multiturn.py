"""Guess-the-number and the calculator tool: the multi-turn protocol, rewards, transcripts."""

import pytest

from trace_lightning.envs import (
    CalculatorEnv,
    ExpressionError,
    GuessNumberEnv,
    MultiTurnEnv,
    Problem,
    Reply,
    evaluate,
    run_episode,
)

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


def test_reply_feedback_and_budget() -> None:
    p, turns = _problem(7), []
    expected = [Reply("higher\n", False), Reply("lower\n", False), Reply("invalid\n", False),
                Reply("higher\n", False), Reply("higher\n", True)]  # the fifth turn: out of guesses
    for turn, reply in zip(["3 ", "12 ", "seven ", "1 ", "2 "], expected, strict=True):
        turns.append(turn)
        assert ENV.reply(p, turns) == reply
    with pytest.raises(ValueError, match="exceed max_turns"):
        ENV.reply(p, [*turns, "7 "])
    assert ENV.reply(p, ["7 "]) == Reply("correct\n", True, 1.0)
    with pytest.raises(ValueError, match="after the episode ended"):
        ENV.reply(p, ["7 ", "8 "])
    with pytest.raises(ValueError, match="at least one"):
        ENV.reply(p, [])


def test_context_grows_with_turns_and_replies() -> None:
    contexts: list[str] = []

    def policy(ctx: str) -> str:
        contexts.append(ctx)
        return "1 "

    episode = run_episode(ENV, _problem(2), policy)
    assert episode.reward == 0.0 and len(episode.turns) == 5 and episode.done
    assert contexts[1] == "guess 1-15:\n1 higher\n"
    assert episode.transcript == "1 higher\n" * 5


def test_score_replays_transcript_and_sampling_is_seeded() -> None:
    assert ENV.score(_problem(7), "8\n4\n7\n") == 1.0
    assert ENV.score(_problem(7), "8\n4\n6\n5\n3\n7\n") == 0.0  # the sixth guess is past the five-turn budget
    assert [p.answer for p in ENV.sample(8, seed=1)] == [p.answer for p in ENV.sample(8, seed=1)]
    assert all(1 <= int(p.answer) <= 15 for p in ENV.sample(50, seed=2))


@pytest.mark.parametrize(("text", "value"), [("37*24", 888), (" 888 + 5 ", 893), ("-(2+3)*4", -20), ("7-2-1", 4),
                                             ("8/2/2", 2), ("2*(3+(4-1))", 12), ("--3", 3), ("10-2*3", 4)])
def test_evaluate_integer_arithmetic(text: str, value: int) -> None:
    assert evaluate(text) == value


@pytest.mark.parametrize(("text", "error"), [
    ("__import__('os')", "unexpected character '_'"), ("2**8", "expected a number"), ("1/0", "division by zero"),
    ("7/2", "not an integer"), ("(1+2", "missing"), ("1 2", "unexpected '2'"), ("", "ends too early"),
    ("9" * 13, "exceeds"), ("1" + "+1" * 40, "longer than"), ("(" * 17 + "1" + ")" * 17, "nested deeper")])
def test_evaluate_rejects_what_is_not_arithmetic(text: str, error: str) -> None:
    with pytest.raises(ExpressionError, match=error):
        evaluate(text)


def test_calculator_episode_uses_the_tool_and_answers() -> None:
    env = CalculatorEnv()
    assert isinstance(env, MultiTurnEnv)
    p = Problem("what is 37*24+5?\n", "893", {"a": 37, "b": 24, "c": 5})
    assert env.demonstration(p) == "calc 37*24\n=888\ncalc 888+5\n=893\nanswer 893\ncorrect\n"
    assert env.score(p, env.demonstration(p)) == 1.0
    assert env.reply(p, ["calc 1/0\n"]) == Reply("error: division by zero\n", False)
    assert env.reply(p, ["hello\n"]) == Reply("invalid\n", False)
    assert env.reply(p, ["answer 892\n"]) == Reply("wrong\n", True, 0.0)
    assert env.reply(p, ["calc 1\n"] * 4) == Reply("=1\n", True)  # the last turn: the episode ends unanswered
    assert env.score(p, "calc 1\n=1\nanswer 892\nwrong\n") == 0.0
    problems = env.sample(20, seed=3)
    assert all(env.score(q, env.demonstration(q)) == 1.0 for q in problems)
    assert [q.prompt for q in problems] == [q.prompt for q in env.sample(20, seed=3)]
