"""The parent's side of the result channel: only the runner's report counts, per call, and parsing never raises."""

import os
import signal

from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning.envs.sandbox import _parse, run_sandboxed

EXIT_0 = 0  # a wait status: exited with 0
KILLED_XCPU = signal.SIGXCPU.value  # a wait status: killed by SIGXCPU


def record(body: bytes, status: int = EXIT_0, over: int = 0, size: int | None = None) -> bytes:
    return f"{status} {over} {len(body) if size is None else size}\n".encode() + body


def frame(literal: bytes) -> bytes:
    return b"\n\x1e" + literal + b"\n"


def report(*records: bytes) -> bytes:
    return b"".join(records) + b"end\n"


def test_a_report_is_read_per_call() -> None:
    good = report(record(frame(b"('ok',5)")), record(frame(b"('error','ZeroDivisionError')")))
    assert _parse(good, 2).outputs == [("ok", 5), ("error", "ZeroDivisionError")]
    # What the code printed before the harness's frame does not count: the last frame does.
    printed = record(b"noise\n\x1e('ok',1)\n" + frame(b"('ok',5)"))
    assert _parse(report(printed), 1).outputs == [("ok", 5)]
    assert _parse(report(record(frame(b"('load','NameError')"))), 1).detail == "NameError"
    assert os.WIFSIGNALED(KILLED_XCPU)


def test_each_call_fails_alone_with_a_reason() -> None:
    cases = {
        record(frame(b"('ok',5)"), status=KILLED_XCPU): ("error", "SIGXCPU"),
        record(frame(b"('ok',5)"), status=3 << 8): ("error", "exit 3"),
        record(frame(b"('ok',5)"), over=1): ("error", "OutputLimit"),
        record(b"('ok',5)\n"): ("error", "NoResult"),
        record(frame(b"('ok',5)") + b"after"): ("error", "NoResult"),
        record(frame(b"__import__('os').system('true')")): ("error", "BadResult"),
        record(frame(b"[" * 100_000)): ("error", "BadResult"),
        record(frame(b"'\xff'")): ("error", "BadResult"),
        record(frame(b"('maybe',5)")): ("error", "BadResult"),
        record(frame(b"('error',5)")): ("error", "BadResult"),
        record(frame(b"('ok',{'a': 1})")): ("error", "BadResult"),  # f could not have returned a dict
        record(frame(b"('ok',b'x')")): ("error", "BadResult"),
        record(frame(b"('ok',1e999)")): ("error", "BadResult"),
    }
    for rec, want in cases.items():
        result = _parse(report(rec, record(frame(b"('ok',7)"))), 2)
        assert result.status == "ok" and result.outputs == [want, ("ok", 7)], (rec[:60], result)


def test_a_malformed_report_is_crashed_with_a_reason() -> None:
    one = record(frame(b"('ok',5)"))
    cases = {
        b"": "bad record header",
        one: "no end of report",
        report(one) + b"more": "no end of report",
        report(one, one): "no end of report",  # two records for one call
        report(record(frame(b"('ok',5)"), size=99)): "truncated record",
        report(record(b"x", size=10**13)): "bad record header",
        b"-1 0 3\nabcend\n": "bad record header",
    }
    for data, reason in cases.items():
        result = _parse(data, 1)
        assert result.status == "crashed" and result.detail.startswith(reason), (data[:60], result)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 3))
def test_parse_never_raises(before: bytes, body: bytes, n_calls: int) -> None:
    for data in (before, before + report(record(body)), report(record(frame(body))), report(record(body))[:-1]):
        assert _parse(data, n_calls).status in ("ok", "error", "crashed")


def test_code_cannot_rebind_how_the_harness_reports() -> None:
    """Rebinding the harness module's names (or builtins) does not change what it reports f returned."""
    code = (
        "import sys, builtins\nm = sys.modules['__main__']\n"
        "m._literal = lambda v, depth=0: repr(v + 1000)\nm._name = lambda e: repr('Forged')\n"
        "m._call = lambda *a: None\n"
        "builtins.repr = lambda v: '0'\nbuiltins.type = lambda v: int\n"
        "def f(x):\n    return x if x else 1 // x"
    )
    assert run_sandboxed(code, "f", [(5,), (0,)]).outputs == [("ok", 5), ("error", "ZeroDivisionError")]
