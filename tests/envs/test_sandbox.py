"""The parent's side of the result channel: only the harness's token frame counts, and parsing never raises."""

from hypothesis import given, settings
from hypothesis import strategies as st

from trace_lightning.envs.sandbox import _parse, run_sandboxed

TOKEN = b"0123456789abcdef0123456789abcdef"


def frame(payload: bytes, token: bytes = TOKEN, size: int | None = None) -> bytes:
    return b"\n" + token + b" " + str(len(payload) if size is None else size).encode() + b"\n" + payload


def test_the_token_frame_is_read_and_checked() -> None:
    good = frame(b"('ok',[('ok',5),('error','ZeroDivisionError')])")
    assert _parse(good, TOKEN, 2).outputs == [("ok", 5), ("error", "ZeroDivisionError")]
    assert _parse(b"noise\n" + good + b"trailing", TOKEN, 2).status == "ok"
    assert _parse(frame(b"('error','NameError')"), TOKEN, 1).detail == "NameError"


def test_anything_else_is_crashed_with_a_reason() -> None:
    cases = {
        b"\x00__sandbox_results__:('ok',[('ok',5)])\n": "no result frame",
        frame(b"('ok',[('ok',5)])", token=b"f" * 32): "no result frame",
        frame(b"('ok',[('ok',5)])", size=-1): "bad result header",
        frame(b"('ok',[('ok',5)])", size=10**13): "bad result header",
        frame(b"('ok',[('ok',5)])", size=99): "truncated result",
        frame(b"__import__('os').system('true')"): "unparseable result: ValueError",
        frame(b"[" * 100_000): "unparseable result",
        frame(b"'\xff'"): "unparseable result: UnicodeDecodeError",
        frame(b"('ok',[1])"): "malformed result",
        frame(b"('ok',[('ok',5),('ok',6)])"): "malformed result",  # two results for one call
        frame(b"('ok',[('maybe',5)])"): "malformed result",
        frame(b"('ok',[('error',5)])"): "malformed result",
        frame(b"('error',5)"): "malformed result",
        frame(b"{'ok': 1}"): "malformed result",
    }
    for data, reason in cases.items():
        result = _parse(data, TOKEN, 1)
        assert result.status == "crashed" and result.detail.startswith(reason), (data[:60], result)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300), st.integers(0, 3))
def test_parse_never_raises(before: bytes, payload: bytes, n_calls: int) -> None:
    for data in (before, before + frame(payload), before + frame(payload)[:-1]):
        assert _parse(data, TOKEN, n_calls).status in ("ok", "error", "crashed")


def test_code_cannot_rebind_how_the_harness_reports() -> None:
    """Rebinding the harness module's names (or builtins) does not change what it reports f returned."""
    code = (
        "import sys, builtins\nm = sys.modules['__main__']\n"
        "m._literal = lambda v, depth=0: repr(v + 1000)\nm._name = lambda e: repr('Forged')\n"
        "builtins.repr = lambda v: '0'\nbuiltins.type = lambda v: int\n"
        "def f(x):\n    return x if x else 1 // x"
    )
    assert run_sandboxed(code, "f", [(5,), (0,)]).outputs == [("ok", 5), ("error", "ZeroDivisionError")]
