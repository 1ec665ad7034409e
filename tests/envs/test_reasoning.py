"""reasoning-gym envs: compact prompts, exact demonstrations, robust extraction, reproducible sampling."""

import string

import pytest

from trace_lightning.envs import ANSWER_FORMATS, ReasoningGymEnv, extract_answer, make_env

PRINTABLE = set(string.printable)


@pytest.mark.parametrize("name", ["arithmetic", "chain_sum"])
def test_sim_presets_short_and_consistent(name: str) -> None:
    env = make_env(name, size=500, seed=0)
    for p in env.sample(50, seed=3):
        assert p.prompt.endswith("=") and len(p.prompt) + len(p.answer) <= 16
        assert set(p.prompt) <= PRINTABLE and p.prompt.isascii()
        assert eval(p.prompt[:-1]) == int(p.answer)  # our own prompt: digits and + - only
        assert env.score(p, env.demonstration(p)) == 1.0
        assert env.score(p, str(int(p.answer) + 1)) == 0.0


def test_arithmetic_preset_uses_two_one_digit_terms() -> None:
    env = make_env("arithmetic", size=200)
    prompts = [p.prompt for p in env.sample(200, seed=0)]
    assert all("*" not in q and "/" not in q and "(" not in q for q in prompts)
    assert {q.count("+") + q.count("-") for q in prompts} == {1}


def test_extraction_takes_leading_answer_only() -> None:
    env = make_env("arithmetic", size=50)
    p = next(q for q in env.sample(50, seed=0) if int(q.answer) > 0)
    assert env.score(p, f"  {p.answer}\n") == 1.0
    assert env.score(p, f"{p.answer}<eos>junk") == 1.0
    assert env.score(p, f"x{p.answer}") == 0.0
    assert env.score(p, "") == 0.0
    assert env.score(p, "   \n") == 0.0


def test_partial_credit_is_rounded_down_unless_asked() -> None:
    strict = ReasoningGymEnv("basic_arithmetic", size=10, seed=0, prompt_format="expression", answer_format="integer")
    lenient = ReasoningGymEnv(
        "basic_arithmetic", size=10, seed=0, prompt_format="expression", answer_format="integer", partial_credit=True
    )
    p = next(q for q in strict.sample(10, seed=0) if len(q.answer) == 1 and q.answer != "1")
    assert strict.score(p, "1" + p.answer) == 0.0
    assert lenient.score(p, "1" + p.answer) == 0.5  # reasoning-gym: len(answer) / len(response)


def test_sampling_reproducible_by_seed() -> None:
    a = make_env("chain_sum", size=1000, seed=7)
    b = make_env("chain_sum", size=1000, seed=7)
    first = [p.prompt for p in a.sample(20, seed=11)]
    assert first == [p.prompt for p in b.sample(20, seed=11)]
    assert first != [p.prompt for p in a.sample(20, seed=12)]
    assert len({p.metadata["index"] for p in a.sample(20, seed=11)}) == 20  # distinct problems


def test_each_problem_is_built_once() -> None:
    """reasoning-gym builds an item on every access (a countdown one in ~2.5 ms): the env builds each index once,
    and what it hands out again is what it built (and what a fresh env builds)."""
    env = make_env("countdown", size=200, seed=3)
    built: list[int] = []
    data = env.data

    class Counting:
        def __getitem__(self, index: int) -> object:
            built.append(index)
            return data[index]

        def __getattr__(self, name: str) -> object:
            return getattr(data, name)

    env.data = Counting()
    first = env.sample(30, seed=5)
    again = env.sample(30, seed=5)
    assert len(built) == len(set(built)) == 30 and all(a is b for a, b in zip(first, again, strict=True))
    fresh = make_env("countdown", size=200, seed=3).sample(30, seed=5)
    assert [(p.prompt, p.answer) for p in first] == [(p.prompt, p.answer) for p in fresh]
    env.data = data  # the guard refuses answers for a verifier it does not know, such as the counting proxy
    assert env.score(first[0], env.demonstration(first[0])) == 1.0


def test_countdown_demonstration_and_wrong_answers() -> None:
    env = make_env("countdown", size=50)
    for p in env.sample(10, seed=0):
        assert len(p.prompt) <= 128 and " " not in p.answer
        assert env.score(p, env.demonstration(p)) == 1.0
        nums = p.metadata["rg_metadata"]["numbers"]
        assert env.score(p, "+".join(map(str, nums)) + "+1") == 0.0  # wrong numbers: 0.05 -> 0
    p = env.sample(1, seed=0)[0]
    assert env.score(p, "9**9**9**9") == 0.0  # never handed to the verifier's evaluator


def test_extract_answer_formats() -> None:
    assert extract_answer(" -12abc", ANSWER_FORMATS["integer"]) == "-12"
    assert extract_answer("3*(4+5) done", ANSWER_FORMATS["expression"]) == "3*(4+5)"
    assert extract_answer("2**8", ANSWER_FORMATS["expression"]) is None
    assert extract_answer("first line\nsecond", ANSWER_FORMATS["line"]) == "first line"
    assert extract_answer("1" * 65, ANSWER_FORMATS["integer"]) is None


def test_unknown_formats_rejected() -> None:
    with pytest.raises(ValueError, match="prompt format"):
        ReasoningGymEnv("chain_sum", size=5, prompt_format="latex")


def test_the_held_out_env_draws_problems_training_never_draws() -> None:
    """Evaluation's env is the same task from the next `size` item seeds: countdown problems from a disjoint range
    (their (numbers, target) pairs never repeat training's here), scored the same way."""
    train = make_env("countdown", size=300, seed=4)
    held = train.held_out()
    assert (held.size, held.seed, held.name) == (300, 304, "countdown")

    def key(p: object) -> tuple:
        md = p.metadata["rg_metadata"]  # type: ignore[attr-defined]
        return tuple(md["numbers"]), md["target"]

    seen = {key(train.problem(i)) for i in range(train.size)}
    evaluated = held.sample(100, seed=10**9)
    assert not seen & {key(p) for p in evaluated}
    assert all(held.score(p, held.demonstration(p)) == 1.0 for p in evaluated[:10])
    assert held.held_out().seed == 604 and held.sample(5, seed=1)[0].prompt != train.sample(5, seed=1)[0].prompt


def test_tagged_answers_for_pretrained_chat_models() -> None:
    """prompt_format "instructed" + answer_format "tagged": reasoning-gym's default system prompt asks for the answer
    in <answer> tags; the last tag counts wherever it is (after a <think> block, say), scored by reasoning-gym."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = make_env("countdown", size=50, prompt_format="instructed", answer_format="tagged")
    p = env.sample(1, seed=0)[0]
    assert p.prompt.startswith(SYSTEM_PROMPTS["default"]) and p.prompt.endswith(p.metadata["question"])
    assert env.demonstration(p) == f"<answer>{p.answer}</answer>" and env.score(p, env.demonstration(p)) == 1.0
    assert env.score(p, f"<think>try 1+1</think>\nSo: <answer>1+1</answer> no, <answer> {p.answer} </answer>") == 1.0
    assert env.score(p, f"<answer>{p.answer}</answer> then <answer>1+1</answer>") == 0.0  # the last one counts
    assert env.score(p, p.answer) == 0.0  # untagged
    assert env.score(p, "<answer>2**99999</answer>") == 0.0  # forbidden in expressions stays with the pattern's
    assert ANSWER_FORMATS["tagged"].tag == "answer"
