"""Coding env and sandbox: correct code 1, wrong 0, hostile code 0, never hangs."""

import time
from pathlib import Path

import pytest

from trace_lightning.envs import CodingEnv, Problem, SandboxUnavailable, program_from_response, run_sandboxed
from trace_lightning.envs.isolation import bwrap_problem

ENV = CodingEnv()
# Start-up and teardown of a sandbox on a loaded 2-core machine; the runs bounded below would otherwise
# never end (an infinite loop, a 30 s sleep), so any bound of a few seconds shows the kill works.
SLACK_S = 2.0
AFFINE = Problem(
    prompt="f(0)=3;f(1)=5;f(2)=7\nf=lambda x:",
    answer="2*x+3",
    metadata={"kind": "int", "tests": [[0], [1], [2], [10], [-4]], "expected": [3, 5, 7, 23, -5]},
)


def test_correct_code_scores_one_wrong_zero() -> None:
    assert ENV.score(AFFINE, " 2*x+3") == 1.0
    assert ENV.score(AFFINE, "3+x*2\nprint('ignored second line')") == 1.0
    assert ENV.score(AFFINE, "def f(x):\n    return 2 * x + 3") == 1.0
    assert ENV.score(AFFINE, "x+3") == 0.0
    assert ENV.score(AFFINE, "2*x+3.0") == 0.0  # float is not int
    assert ENV.score(AFFINE, "x==0 or 5") == 0.0
    assert ENV.score(AFFINE, "2*x+") == 0.0  # syntax error
    assert ENV.score(AFFINE, "") == 0.0


def test_sampled_problems_short_and_demonstrations_pass() -> None:
    problems = CodingEnv().sample(12, seed=0)
    assert [p.prompt for p in problems] == [p.prompt for p in CodingEnv().sample(12, seed=0)]
    assert {p.metadata["kind"] for p in problems} == {"int", "str", "list"}
    for p in problems:
        assert len(p.prompt) <= 128 and p.prompt.isascii() and p.prompt.endswith("f=lambda x:")
        assert ENV.score(p, ENV.demonstration(p)) == 1.0
        assert ENV.score(p, "x") == 0.0


def test_infinite_loop_times_out_fast() -> None:
    start = time.monotonic()
    assert ENV.score(AFFINE, "def f(x):\n    while True:\n        pass") == 0.0
    assert time.monotonic() - start < ENV.timeout_s + SLACK_S


def test_sleep_is_killed_by_wall_timeout() -> None:
    start = time.monotonic()
    result = run_sandboxed("import time\ntime.sleep(30)", "f", [(1,)], timeout_s=0.5)
    assert result.status == "timeout" and time.monotonic() - start < 0.5 + SLACK_S


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('touch {marker}') or 2*x+3",
        "[__import__('sys').modules['posix'].system('touch {marker}'), 2*x+3][1]",
        "def f(x):\n    import os\n    while True:\n        os.fork()",
        "def f(x):\n    p = __import__('sys').modules['posix']\n    while True:\n        p.fork()",
        "def f(x):\n    s = ' ' * (2 ** 34)\n    return 2 * x + 3",
        "len(open('/etc/passwd').read()) * 0 + 2*x+3",
        "__import__('socket').create_connection(('1.1.1.1', 80)) and 2*x+3",
        "def f(x):\n    open('{marker}', 'w').write('x')\n    return 2 * x + 3",
        "__import__('ctypes') and 2*x+3",
        "def f(x):\n    while True:\n        print('x' * 100000)",
        "__import__('sys').exit(0)",
        "__import__('sys').modules['resource'].setrlimit(0, (-1, -1)) or 2*x+3",
    ],
)
def test_hostile_code_gets_zero_and_does_no_harm(code: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    start = time.monotonic()
    assert ENV.score(AFFINE, code.format(marker=marker)) == 0.0
    assert time.monotonic() - start < ENV.timeout_s + SLACK_S
    assert not marker.exists()


def test_sandbox_reports_values_and_errors() -> None:
    result = run_sandboxed("def f(x):\n    return 10 // x", "f", [(2,), (0,)])
    assert result.status == "ok" and result.outputs == [("ok", 5), ("error", "ZeroDivisionError")]
    assert run_sandboxed("g = 1", "f", [(1,)]).status == "error"  # no f defined


def test_program_from_response() -> None:
    assert program_from_response(" x*2 \nmore") == "f = lambda x: (x*2)"
    assert program_from_response("def f(x):\n  return x") == "def f(x):\n  return x"
    assert program_from_response("  \n ") is None


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A PATH without bwrap (the availability probe is cached, so clear it on both sides)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    bwrap_problem.cache_clear()
    yield
    bwrap_problem.cache_clear()


@pytest.mark.usefixtures("no_bwrap")
def test_refuses_to_start_without_bwrap_unless_weaker_mode_is_chosen() -> None:
    with pytest.raises(SandboxUnavailable, match=r"`bwrap` executable was not found.*apt-get install bubblewrap"):
        CodingEnv()
    with pytest.raises(SandboxUnavailable, match="isolation='none'"):
        run_sandboxed("f = abs", "f", [(1,)])
    weak = CodingEnv(isolation="none")
    assert weak.score(AFFINE, " 2*x+3") == 1.0 and weak.score(AFFINE, " x") == 0.0


def test_unknown_isolation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown isolation 'docker'"):
        CodingEnv(isolation="docker")
