"""The exception tree, status mapping and upstream message format."""

from __future__ import annotations

import ast
import contextvars
import copy
import pickle
import re
from pathlib import Path

import pytest

from aiodatadist import errors
from aiodatadist.errors import (
    NATIVE_STATUS_NAMES,
    NATIVE_STATUS_TABLE,
    LLMCacheNotFoundError,
    LLMException,
    LLMLinkError,
    LLMParamError,
    LLMStatusCode,
    LLMTimeoutError,
    Status,
    api_scope,
    current_api,
    failure,
    format_error,
    from_native,
    raise_for_status,
    to_status_code,
)

S = LLMStatusCode

CLASS_FOR_CODE: dict[LLMStatusCode, tuple[type[LLMException], type[BaseException]]] = {
    S.LLM_TIMEOUT: (LLMTimeoutError, TimeoutError),
    S.LLM_WAIT_PROCESS_TIMEOUT: (LLMTimeoutError, TimeoutError),
    S.LLM_PARAM_INVALID: (LLMParamError, ValueError),
    S.LLM_NOT_YET_LINK: (LLMLinkError, ConnectionError),
    S.LLM_LINK_FAILED: (LLMLinkError, ConnectionError),
    S.LLM_UNLINK_FAILED: (LLMLinkError, ConnectionError),
    S.LLM_ALREADY_LINK: (LLMLinkError, ConnectionError),
    S.LLM_LINK_BUSY: (LLMLinkError, ConnectionError),
    S.LLM_PROCESSING_LINK: (LLMLinkError, ConnectionError),
    S.LLM_NOTIFY_PROMPT_UNLINK_FAILED: (LLMLinkError, ConnectionError),
    S.LLM_EXIST_LINK: (LLMLinkError, ConnectionError),
    S.LLM_KV_CACHE_NOT_EXIST: (LLMCacheNotFoundError, LookupError),
}
PLAIN_CODES = [code for code in LLMStatusCode if code not in CLASS_FOR_CODE]

SUBCLASSES = [
    (LLMTimeoutError, S.LLM_TIMEOUT, TimeoutError),
    (LLMParamError, S.LLM_PARAM_INVALID, ValueError),
    (LLMLinkError, S.LLM_LINK_FAILED, ConnectionError),
    (LLMCacheNotFoundError, S.LLM_KV_CACHE_NOT_EXIST, LookupError),
]


class FakeNativeError(Exception):
    """Shaped like ``aiodatadist._native.NativeError``."""

    def __init__(self, status: int, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.errno = errno


@pytest.mark.parametrize(("code", "classes"), list(CLASS_FOR_CODE.items()), ids=str)
def test_root_dispatches_on_status(
    code: LLMStatusCode, classes: tuple[type[LLMException], type[BaseException]]
) -> None:
    cls, builtin = classes
    err = LLMException("boom", status_code=code)
    assert type(err) is cls
    assert isinstance(err, LLMException)
    assert isinstance(err, RuntimeError)
    assert isinstance(err, builtin)
    assert err.status_code is code
    assert str(err) == "boom"


@pytest.mark.parametrize("code", PLAIN_CODES, ids=str)
def test_other_codes_stay_plain(code: LLMStatusCode) -> None:
    err = LLMException("boom", status_code=code)
    assert type(err) is LLMException
    assert err.status_code is code


@pytest.mark.parametrize(("cls", "code", "builtin"), SUBCLASSES)
def test_subclass_natural_code(
    cls: type[LLMException], code: LLMStatusCode, builtin: type[BaseException]
) -> None:
    err = cls("boom")
    assert err.status_code is code
    assert isinstance(err, builtin)
    assert isinstance(err, LLMException)
    with pytest.raises(builtin, match=r"boom"):
        raise err


def test_subclass_accepts_explicit_code() -> None:
    err = LLMTimeoutError("slow", status_code=S.LLM_WAIT_PROCESS_TIMEOUT)
    assert err.status_code is S.LLM_WAIT_PROCESS_TIMEOUT


def test_root_default_code_is_success_like_upstream() -> None:
    err = LLMException("x")
    assert type(err) is LLMException
    assert err.status_code is S.LLM_SUCCESS


def test_int_status_is_converted() -> None:
    err = LLMException("x", status_code=0x5010B01A)
    assert err.status_code is S.LLM_TIMEOUT
    assert isinstance(err, LLMTimeoutError)


def test_unknown_int_status_becomes_failed() -> None:
    err = LLMException("x", status_code=12345)
    assert err.status_code is S.LLM_FAILED
    assert type(err) is LLMException


def test_status_must_be_int() -> None:
    with pytest.raises(TypeError, match=r"status_code must be LLMStatusCode or int, got str"):
        LLMException("x", status_code="LLM_TIMEOUT")  # type: ignore[arg-type]


def test_several_args_behave_like_runtime_error() -> None:
    # OSError-based builtins would read two arguments as (errno, strerror).
    err = LLMLinkError("a", "b")
    assert err.args == ("a", "b")
    assert str(err) == str(RuntimeError("a", "b"))
    assert LLMTimeoutError().args == ()


def test_user_subclass_of_root() -> None:
    class MyError(LLMException):
        pass

    err = MyError("x", status_code=S.LLM_TIMEOUT)
    assert type(err) is MyError
    assert err.status_code is S.LLM_TIMEOUT


@pytest.mark.parametrize(
    "err",
    [
        LLMException("plain", status_code=S.LLM_FAILED),
        LLMException("t", status_code=S.LLM_TIMEOUT),
        LLMTimeoutError("w", status_code=S.LLM_WAIT_PROCESS_TIMEOUT),
        LLMParamError("p"),
        LLMLinkError("l", "two"),
        LLMCacheNotFoundError("c"),
        LLMException(),
    ],
    ids=repr,
)
def test_pickle_round_trip(err: LLMException) -> None:
    err.extra = 42  # type: ignore[attr-defined]
    for clone in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
        assert type(clone) is type(err)
        assert clone.args == err.args
        assert str(clone) == str(err)
        assert clone.status_code is err.status_code
        assert clone.extra == 42  # type: ignore[attr-defined]


def test_to_status_code() -> None:
    assert to_status_code(S.LLM_TIMEOUT) is S.LLM_TIMEOUT
    assert to_status_code(0) is S.LLM_SUCCESS
    assert to_status_code(-1) is S.LLM_UNKNOWN_ERROR
    assert to_status_code(7) is S.LLM_FAILED
    with pytest.raises(TypeError, match=r"got bool"):
        to_status_code(True)


def test_format_error_matches_upstream() -> None:
    assert (
        format_error("pull_blocks", S.LLM_TIMEOUT, "cluster 7")
        == "[pull_blocks] failed, error code is LLMStatusCode.LLM_TIMEOUT, cluster 7."
    )
    assert (
        format_error("link", 0x5010B009)
        == "[link] failed, error code is LLMStatusCode.LLM_LINK_FAILED."
    )
    assert format_error("x", 99, "i") == "[x] failed, error code is LLMStatusCode.LLM_FAILED, i."


def test_raise_for_status() -> None:
    raise_for_status(S.LLM_SUCCESS, "pull_cache")
    raise_for_status(0, "pull_cache")
    with pytest.raises(LLMCacheNotFoundError) as info:
        raise_for_status(S.LLM_KV_CACHE_NOT_EXIST, "pull_cache", "key (1, 2)")
    assert info.value.status_code is S.LLM_KV_CACHE_NOT_EXIST
    assert str(info.value) == (
        "[pull_cache] failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, key (1, 2)."
    )
    with pytest.raises(LLMException, match=r"LLM_FAILED") as info2:
        raise_for_status(42, "init")
    assert info2.value.status_code is S.LLM_FAILED


def test_status_helper() -> None:
    assert Status(S.LLM_SUCCESS).is_ok()
    bad = Status(S.LLM_TIMEOUT)
    assert not bad.is_ok()
    assert bad.status_code is S.LLM_TIMEOUT
    assert Status(3).status_code is S.LLM_FAILED


ROOT = Path(__file__).resolve().parent.parent


def core_status() -> dict[str, int]:
    """``enum class Status`` of ext/core.hpp, the one source: name -> value."""
    text = (ROOT / "ext" / "core.hpp").read_text()
    body = re.search(r"enum class Status\s*:\s*int\s*\{(.*?)\};", text, re.S)
    assert body is not None, "no `enum class Status : int { ... };` in ext/core.hpp"
    code = re.sub(r"//[^\n]*|/\*.*?\*/", "", body.group(1), flags=re.S)
    entries = [e.strip() for e in code.split(",") if e.strip()]
    status: dict[str, int] = {}
    for entry in entries:
        m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)\s*=\s*(\d+)", entry)
        assert m is not None, f"unparsed Status entry {entry!r}: give every entry a value"
        status[m.group(1)] = int(m.group(2))
    return status


def binding_status() -> dict[str, str]:
    """``py::native_enum<Status>`` of ext/bindings.cpp: Python name -> C++ enumerator."""
    text = (ROOT / "ext" / "bindings.cpp").read_text()
    block = re.search(r"native_enum<Status>(.*?)\.finalize\(\)", text, re.S)
    assert block is not None, "no py::native_enum<Status> in ext/bindings.cpp"
    return dict(re.findall(r'\.value\("(\w+)",\s*Status::(\w+)\)', block.group(1)))


def stub_status() -> dict[str, int]:
    """``class Status`` of aiodatadist/_native.pyi: name -> value."""
    tree = ast.parse((ROOT / "aiodatadist" / "_native.pyi").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Status")
    out: dict[str, int] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign):
            (target,) = node.targets
            assert isinstance(target, ast.Name) and isinstance(node.value, ast.Constant)
            out[target.id] = node.value.value
    return out


CORE_STATUS = core_status()

# What each native status means to a caller (by name: the values come from core.hpp).
EXPECTED_NATIVE_BY_NAME = {
    "OK": S.LLM_SUCCESS,
    "FAILED": S.LLM_FAILED,
    "PARAM_INVALID": S.LLM_PARAM_INVALID,
    "OUT_OF_RANGE": S.LLM_PARAM_INVALID,
    "OVERLAP": S.LLM_PARAM_INVALID,
    "ABORTED": S.LLM_TIMEOUT,
    "TIMEOUT": S.LLM_TIMEOUT,
    "PERMISSION_DENIED": S.LLM_LINK_FAILED,
    "NO_SUCH_PROCESS": S.LLM_LINK_FAILED,
    "PEER_CLOSED": S.LLM_LINK_FAILED,
    "IO_ERROR": S.LLM_FAILED,
    "NO_MEMORY": S.LLM_OUT_OF_MEMORY,
    "STALE": S.LLM_FAILED,
}
EXPECTED_NATIVE = {CORE_STATUS[name]: code for name, code in EXPECTED_NATIVE_BY_NAME.items()}


def test_core_status_parsed() -> None:
    assert CORE_STATUS["OK"] == 0
    assert len(set(CORE_STATUS.values())) == len(CORE_STATUS), "duplicate native values"
    # A new native status needs a decision here about what it means to callers.
    assert set(EXPECTED_NATIVE_BY_NAME) == set(CORE_STATUS)


def test_native_status_table() -> None:
    assert dict(NATIVE_STATUS_TABLE) == EXPECTED_NATIVE
    with pytest.raises(TypeError):
        NATIVE_STATUS_TABLE[99] = S.LLM_FAILED  # type: ignore[index]


def test_native_status_table_matches_core_header() -> None:
    assert set(NATIVE_STATUS_TABLE) == set(CORE_STATUS.values())
    assert dict(NATIVE_STATUS_NAMES) == {v: k for k, v in CORE_STATUS.items()}


def test_native_status_binding_matches_core_header() -> None:
    binding = binding_status()
    assert all(py == cpp for py, cpp in binding.items()), binding
    assert list(binding) == list(CORE_STATUS)


def test_native_status_stub_matches_core_header() -> None:
    assert stub_status() == CORE_STATUS


def test_native_status_table_matches_native_module() -> None:
    native = pytest.importorskip("aiodatadist._native")
    assert {name: int(m) for name, m in native.Status.__members__.items()} == CORE_STATUS
    assert set(NATIVE_STATUS_TABLE) == {int(m) for m in native.Status}


@pytest.mark.parametrize(("native", "code"), [(k, v) for k, v in EXPECTED_NATIVE.items() if k])
def test_from_native_maps_status(native: int, code: LLMStatusCode) -> None:
    err = from_native(FakeNativeError(native, "it broke"), "pull_blocks")
    assert err.status_code is code
    assert type(err) is type(LLMException("", status_code=code))
    assert str(err) == f"[pull_blocks] failed, error code is {code}, it broke."


def test_from_native_success_status_is_still_a_failure() -> None:
    err = from_native(FakeNativeError(0, "odd"), "copy_blocks")
    assert err.status_code is S.LLM_FAILED


def test_from_native_unknown_status() -> None:
    err = from_native(FakeNativeError(77, "new code"), "push_blocks")
    assert err.status_code is S.LLM_FAILED
    assert "new code" in str(err)


def test_from_native_appends_errno() -> None:
    err = from_native(FakeNativeError(9, "peer closed", errno=104), "pull_blocks")
    assert isinstance(err, LLMLinkError)
    assert str(err) == (
        "[pull_blocks] failed, error code is LLMStatusCode.LLM_LINK_FAILED, "
        "peer closed (errno 104)."
    )


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (TimeoutError("t"), S.LLM_TIMEOUT),
        (MemoryError(), S.LLM_OUT_OF_MEMORY),
        (ConnectionResetError(104, "reset"), S.LLM_LINK_FAILED),
        (LLMCacheNotFoundError("gone"), S.LLM_KV_CACHE_NOT_EXIST),
        (OSError("io"), S.LLM_FAILED),
        (RuntimeError("other"), S.LLM_FAILED),
    ],
    ids=lambda x: type(x).__name__,
)
def test_from_native_without_status(exc: BaseException, code: LLMStatusCode) -> None:
    err = from_native(exc, "link_clusters")
    assert err.status_code is code
    assert str(err).startswith(f"[link_clusters] failed, error code is {code}, ")


def test_from_native_oserror_errno_not_repeated() -> None:
    err = from_native(ConnectionResetError(104, "reset"), "pull_cache")
    assert str(err).count("104") == 1


def test_from_native_used_with_raise_from() -> None:
    native = FakeNativeError(6, "deadline")
    with pytest.raises(TimeoutError) as info:
        try:
            raise native
        except FakeNativeError as e:
            raise from_native(e, "pull_blocks") from e
    assert info.value.__cause__ is native
    assert isinstance(info.value, LLMTimeoutError)


def test_module_docstring_draws_the_tree() -> None:
    doc = errors.__doc__ or ""
    for name in ("LLMException", "LLMTimeoutError", "LLMParamError", "LLMLinkError"):
        assert name in doc
    assert "LLMCacheNotFoundError" in doc


def test_all_names_exist() -> None:
    for name in errors.__all__:
        assert hasattr(errors, name), name


def test_failure_uses_the_api_scope() -> None:
    assert current_api() == "aiodatadist"
    err = failure(S.LLM_TIMEOUT, "slow")
    assert isinstance(err, LLMTimeoutError)
    assert str(err) == "[aiodatadist] failed, error code is LLMStatusCode.LLM_TIMEOUT, slow."
    with api_scope("pull_blocks"):
        assert current_api() == "pull_blocks"
        assert str(failure(S.LLM_PARAM_INVALID)) == (
            "[pull_blocks] failed, error code is LLMStatusCode.LLM_PARAM_INVALID."
        )
        # A task started inside copies the context, so it names the same call.
        ctx = contextvars.copy_context()
        assert ctx.run(current_api) == "pull_blocks"
        assert "[link] failed" in str(failure(S.LLM_FAILED, "x", api="link"))
    assert current_api() == "aiodatadist"


def test_failure_kind_picks_a_more_specific_class() -> None:
    class Stale(LLMCacheNotFoundError):
        pass

    err = failure(S.LLM_KV_CACHE_NOT_EXIST, "gone", api="pull_blocks", kind=Stale)
    assert type(err) is Stale
    assert err.status_code is S.LLM_KV_CACHE_NOT_EXIST
    assert (
        str(err)
        == "[pull_blocks] failed, error code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, gone."
    )


def test_from_native_uses_the_api_scope() -> None:
    with api_scope("push_cache"):
        err = from_native(FakeNativeError(9, "closed"))
    assert str(err).startswith("[push_cache] failed, error code is LLMStatusCode.LLM_LINK_FAILED")
