"""pytest plugin (entry point ``pytest11``: ``aiodatadist``): real prompt/decoder pairs and faults.

Installed with the package; nothing to enable. The fixtures are async and run on
pytest-asyncio's event loop, so they are registered only when ``pytest_asyncio`` is
importable (the marker always is). Use them from ``@pytest.mark.asyncio`` tests:

``datadist_pair``
    A linked prompt/decoder pair. By default both live in this process and link
    in-process (an :class:`aiodatadist.testing.Pair`). Configure it with the marker::

        @pytest.mark.datadist(data_path="tcp")                       # one process, real sockets
        @pytest.mark.datadist(data_path="tcp", cross_process=True)   # prompt in a subprocess

    or by indirect parametrization with the same keywords::

        @pytest.mark.parametrize("datadist_pair", [{"data_path": "shm"}], indirect=True)

``datadist_remote_pair``
    Always cross-process (an :class:`aiodatadist.testing.RemotePair`): the prompt runs in
    a subprocess serving one blocks cache filled with a seeded pattern
    (``pair.spec``; check pulled bytes with ``pair.mismatches(...)``), the decoder lives
    in this process, linked over loopback through a :class:`FaultInjector`
    (``pair.faults``) unless ``faults=False``.

``datadist_faults``
    The :class:`aiodatadist.testing.FaultInjector` of ``datadist_remote_pair``:
    ``pause()`` / ``resume()`` / ``delay(s)`` stall the link's bytes, ``await drop()``
    breaks its connections, ``kill_peer()`` SIGKILLs the prompt process.

``datadist_pair_factory``
    ``await datadist_pair_factory(**keywords)`` makes more pairs (fresh cluster ids each);
    all are torn down after the test.

Marker keywords (``@pytest.mark.datadist(...)``):

* ``data_path``: ``auto``, ``inproc``, ``shm``, ``cma`` or ``tcp`` (default ``auto``);
* ``cross_process``: the prompt in a subprocess (default False for ``datadist_pair``);
* ``faults``: link a cross-process pair through a fault injector (default True); its
  proxy leaves only ``tcp`` for transfers (``shm``/``cma`` need a direct link);
* ``spec``: the prompt's :class:`aiodatadist.testing.PromptSpec` (or a dict of its fields);
* ``options`` / ``prompt_options``: extra ``init`` options of the decoder / prompt;
* ``prompt_id`` / ``decoder_id``: cluster ids (default 1 and 2).

Every pair is finalized after its test and every subprocess reaped (killed if it
does not stop in time).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import pytest

if TYPE_CHECKING:
    from .testing import FaultInjector, Pair, RemotePair

__all__ = ["pytest_configure"]

MARKER = "datadist"
_KEYS = frozenset(
    {
        "data_path",
        "cross_process",
        "faults",
        "spec",
        "options",
        "prompt_options",
        "prompt_id",
        "decoder_id",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(data_path='auto', cross_process=False, faults=True, spec=None, options=None, "
        "prompt_options=None, prompt_id=1, decoder_id=2): configures the aiodatadist pair "
        "fixtures (datadist_pair, datadist_remote_pair)",
    )


def _settings(request: pytest.FixtureRequest, **defaults: Any) -> dict[str, Any]:
    """Marker keywords, overridden by an indirect parameter, over ``defaults``."""
    out = dict(defaults)
    marker = request.node.get_closest_marker(MARKER)
    if marker is not None:
        if marker.args:
            raise pytest.UsageError(f"@pytest.mark.{MARKER} takes keywords only")
        out.update(marker.kwargs)
    param = getattr(request, "param", None)
    if isinstance(param, dict):
        out.update(param)
    elif param is not None:
        raise pytest.UsageError(f"{request.fixturename}: an indirect parameter must be a dict")
    unknown = set(out) - _KEYS
    if unknown:
        raise pytest.UsageError(
            f"@pytest.mark.{MARKER}: unknown keyword(s) {sorted(unknown)}; known: {sorted(_KEYS)}"
        )
    return out


def _open_pair(
    stack: contextlib.AsyncExitStack, settings: dict[str, Any]
) -> Awaitable[Pair | RemotePair]:
    from .config import DataPath
    from .testing import PromptSpec, inproc_pair, remote_pair

    s = dict(settings)
    data_path = str(s.pop("data_path", DataPath.AUTO))
    cross = bool(s.pop("cross_process", False))
    faults = bool(s.pop("faults", True))
    spec = s.pop("spec", None)
    if isinstance(spec, dict):
        spec = PromptSpec(**spec)
    ids: dict[str, Any] = {k: int(s.pop(k)) for k in ("prompt_id", "decoder_id") if k in s}
    options = s.pop("options", None)
    prompt_options = s.pop("prompt_options", None)
    cm: contextlib.AbstractAsyncContextManager[Any]
    if cross:
        cm = remote_pair(
            spec,
            data_path=data_path,
            faults=faults,
            options=options,
            prompt_options=prompt_options,
            **ids,
        )
    else:
        if spec is not None or prompt_options is not None:
            raise pytest.UsageError(
                "spec and prompt_options apply to cross_process pairs only "
                "(an in-process pair makes its caches with pair.prompt_cache(...))"
            )
        cm = inproc_pair(options=options, data_path=data_path, **ids)
    return stack.enter_async_context(cm)


try:
    import pytest_asyncio

    HAVE_PYTEST_ASYNCIO = True
except ImportError:  # pragma: no cover - the fixtures need pytest-asyncio
    HAVE_PYTEST_ASYNCIO = False

if HAVE_PYTEST_ASYNCIO:

    @pytest_asyncio.fixture
    async def datadist_pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair | RemotePair]:
        """A linked prompt/decoder pair; finalized (and its subprocess reaped) after the test.

        In-process by default (:class:`aiodatadist.testing.Pair`: ``pair.prompt`` and
        ``pair.decoder`` are ``LLMDataDist`` instances; ``pair.prompt_cache(...)`` /
        ``pair.decoder_cache(...)`` make caches, ``pair.key()`` names the prompt's). With
        ``@pytest.mark.datadist(data_path="shm"|"cma"|"tcp")`` the link is a real loopback
        link between the two instances; with ``cross_process=True`` the prompt runs in a
        subprocess and the fixture is a :class:`aiodatadist.testing.RemotePair` (see
        ``datadist_remote_pair``).

        Raises (at setup):
            pytest.UsageError: unknown marker keywords.
            RuntimeError, LLMException: the pair could not be set up or linked.
        """
        async with contextlib.AsyncExitStack() as stack:
            yield await _open_pair(stack, _settings(request))

    @pytest_asyncio.fixture
    async def datadist_remote_pair(request: pytest.FixtureRequest) -> AsyncIterator[RemotePair]:
        """A decoder here linked over loopback to a prompt in a subprocess.

        A :class:`aiodatadist.testing.RemotePair`: ``pair.decoder`` (``LLMDataDist``),
        ``pair.prompt`` (the :class:`~aiodatadist.testing.PeerProcess`: ``pid``, ``kill()``),
        ``pair.spec`` (the prompt's cache, filled with ``pattern_blocks(spec.seed, ...)``),
        ``pair.key()``, ``pair.decoder_cache()``, ``pair.mismatches(dst, src, dst_blocks)``,
        ``await pair.relink()`` and ``pair.faults`` (the
        :class:`~aiodatadist.testing.FaultInjector` the link goes through; None with
        ``@pytest.mark.datadist(faults=False)``). ``data_path`` defaults to ``auto``;
        the injector stalls transfers only on ``tcp``, where bytes travel on sockets.

        Raises (at setup):
            pytest.UsageError: unknown marker keywords.
            RuntimeError, TimeoutError: the prompt process did not start.
            LLMException: the link failed.
        """
        settings = _settings(request)
        settings["cross_process"] = True
        async with contextlib.AsyncExitStack() as stack:
            yield cast("RemotePair", await _open_pair(stack, settings))

    @pytest_asyncio.fixture
    async def datadist_faults(datadist_remote_pair: RemotePair) -> FaultInjector:
        """The :class:`~aiodatadist.testing.FaultInjector` of ``datadist_remote_pair``.

        ``pause()`` / ``resume()`` / ``delay(seconds)``: stall every byte of the link
        (a pull in flight then raises ``LLMTimeoutError`` at its deadline, and works again
        once resumed); ``await drop()``: abort the link's connections (``LLMException``,
        not a hang); ``kill_peer()``: SIGKILL the prompt process.

        Raises (at setup):
            pytest.UsageError: the remote pair was made with ``faults=False``.
        """
        if datadist_remote_pair.faults is None:
            raise pytest.UsageError("datadist_faults needs a remote pair made with faults=True")
        return datadist_remote_pair.faults

    @pytest_asyncio.fixture
    async def datadist_pair_factory() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
        """``await make(**keywords)``: more pairs (marker keywords), each with fresh cluster
        ids unless given; every pair is torn down after the test, last made first.

        Returns ``Pair`` or ``RemotePair`` as ``datadist_pair`` does.
        """
        async with contextlib.AsyncExitStack() as stack:
            next_id = [1000]

            async def make(**keywords: Any) -> Pair | RemotePair:
                unknown = set(keywords) - _KEYS
                if unknown:
                    raise TypeError(f"unknown keyword(s) {sorted(unknown)}; known: {sorted(_KEYS)}")
                keywords.setdefault("prompt_id", next_id[0])
                keywords.setdefault("decoder_id", next_id[0] + 1)
                next_id[0] += 2
                return await _open_pair(stack, keywords)

            yield make
