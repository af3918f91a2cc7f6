"""Where request bodies are parsed and prompts tokenized: small ones beside everything else, large
ones queued on a thread of their own, the largest parsed in a process of their own."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple, TypeVar

from shared.chat import check_message_count
from shared.cpu_priority import run_at_nice
from shared.errors import InvalidRequestError, ServiceUnavailableError

T = TypeVar("T")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # any surrogate, paired or not
_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_JSON_DEPTH = 64  # nesting levels a request body may use; OpenAI bodies need about 6
# Bodies from here on are parsed off the event loop (json.loads takes about 1 ms per 256 KiB).
PARSE_OFF_LOOP_BYTES = 256 * 1024
# Bodies from here on carry enough text (or token ids) that parsing and tokenizing them takes
# long enough to hold a thread for a while: they queue on the large-input thread.
LARGE_INPUT_BYTES = 64 * 1024
# Bodies from here on are parsed in a process of their own. json.loads never lets go of the GIL
# while it runs (about 50 ms for 5 MB, longer under load), so a few such bodies at once held up
# the event loop and every other request's parse on the threads. The process also refuses a
# `messages` past the limit, so what comes back (unpickled here, under the GIL again) is only a
# body within the limits.
PARSE_IN_PROCESS_BYTES = 1024 * 1024
# Then a fresh process: what a parse left behind is given back. Counted here, not with the
# pool's max_tasks_per_child: on Python 3.11 a pool whose process exits for that leaves parses
# already queued waiting until a later submit starts another (one of 8 bodies sent at once
# waited 120 s, to the client's cap).
PARSES_PER_PROCESS = 32
# The parser runs at nice 10 in the server's session: while the steps keep both cores busy it
# gets about a tenth of one, and a parse that still waits past this is refused with a 503
# (retry later) instead of holding its request. Under SCHED_IDLE it got none: with a stream
# running all the time, 3 of 8 huge bodies met this deadline (docs/reliability.md, "sixth
# round").
PARSER_NICE = 10
PARSE_DEADLINE_S = 30.0


class JsonBody(NamedTuple):
    value: Any  # the parsed body
    large: bool  # its work goes to the large-input thread


class InputWork:
    """Two places to run blocking input work: the loop's default pool, and one thread for large
    inputs, so that one client's huge bodies queue behind each other, not in front of every
    small request."""

    def __init__(self, large_workers: int = 1) -> None:
        self._large = ThreadPoolExecutor(large_workers, thread_name_prefix="large-input")
        self._parser: _Parser | None = None  # started by the first huge body

    async def parse(self, raw: bytes, max_messages: int | None = None) -> JsonBody:
        large = len(raw) >= LARGE_INPUT_BYTES
        if len(raw) < PARSE_OFF_LOOP_BYTES:
            return JsonBody(parse_json(raw), large)
        if len(raw) < PARSE_IN_PROCESS_BYTES:
            return JsonBody(await self.run(True, parse_json, raw), large)
        return JsonBody(await self._parse_in_process(raw, max_messages), large)

    async def _parse_in_process(self, raw: bytes, max_messages: int | None) -> Any:
        if self._parser is None or self._parser.given >= PARSES_PER_PROCESS:
            if self._parser is not None:
                self._parser.retire()
            self._parser = _Parser(asyncio.wrap_future(_start_parser_at_nice()))
        current = self._parser
        current.given += 1
        try:
            parser = await asyncio.shield(current.started)
        except Exception:
            if self._parser is current:
                self._parser = None  # the next huge body tries again
            raise ServiceUnavailableError(
                "the request body parser did not start; retry later", code="parser_failed"
            ) from None
        except asyncio.CancelledError:
            current.given -= 1  # the client went away before its parse was handed over
            current.shut_down_if_done()
            raise
        try:
            parsed = parser.submit(parse_bounded_json, raw, max_messages)
            current.submitted += 1
            current.shut_down_if_done()
            return await asyncio.wait_for(asyncio.wrap_future(parsed), PARSE_DEADLINE_S)
        except TimeoutError:
            # Cancelled if still queued; one under way finishes on leftover time, unheard.
            raise ServiceUnavailableError(
                f"the server is too busy to parse a request body this large within "
                f"{PARSE_DEADLINE_S:g} s; retry later",
                code="parser_busy",
            ) from None
        except BrokenProcessPool:
            # Killed (by the OOM killer, say) while parsing: the next huge body gets a new one.
            if self._parser is current:
                self._parser = None
            parser.shutdown(wait=False, cancel_futures=True)
            raise ServiceUnavailableError(
                "the request body parser stopped; retry later", code="parser_failed"
            ) from None

    async def run(self, large: bool, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._large if large else None, fn, *args)

    def close(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)
        if self._parser is not None and (pool := self._parser.pool()) is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class _Parser:
    """A parser pool being started or started, and the parses given to it. One that has had
    its share is retired: it finishes what it was handed, then exits."""

    def __init__(self, started: asyncio.Future[ProcessPoolExecutor]) -> None:
        self.started = started
        self.given = 0  # parses that chose this pool
        self.submitted = 0  # of those, handed to it (each after awaiting its start)
        self.retired = False
        started.add_done_callback(lambda _: self.shut_down_if_done())

    def retire(self) -> None:
        """Shut down now if every parse given is handed over, else when the last one is."""
        self.retired = True
        self.shut_down_if_done()

    def pool(self) -> ProcessPoolExecutor | None:
        done = self.started.done() and not self.started.cancelled()
        return self.started.result() if done and self.started.exception() is None else None

    def shut_down_if_done(self) -> None:
        if self.retired and self.submitted == self.given and (pool := self.pool()) is not None:
            pool.shutdown(wait=False)  # its parses under way still finish


def _start_parser_at_nice() -> Future[ProcessPoolExecutor]:
    """_start_parser on a thread of its own at PARSER_NICE, so that the forkserver (an
    interpreter and its imports) and the parser start at the parser's priority: a process takes
    the nice value of the thread that starts it."""
    started: Future[ProcessPoolExecutor] = Future()

    def start() -> None:
        run_at_nice(PARSER_NICE, thread=True)
        try:
            started.set_result(_start_parser())
        except BaseException as exc:
            started.set_exception(exc)

    threading.Thread(target=start, name="parser-start", daemon=True).start()
    return started


def _start_parser() -> ProcessPoolExecutor:
    """The parser pool with its process started: run on a thread, never on the event loop.
    Starting the first process starts the forkserver (an interpreter and its imports) and waits
    for it: measured 0.18 s on a loaded 2-core machine, in which the gateway's loop, had it run
    there, sent no stream a token."""
    # forkserver: the gateway runs threads, which a plain fork must not copy.
    context = multiprocessing.get_context("forkserver")
    # Its server would import the gateway's __main__ (transformers and all); the parser needs
    # only this module.
    context.set_forkserver_preload([__name__])
    parser = ProcessPoolExecutor(
        1, mp_context=context, initializer=run_at_nice, initargs=(PARSER_NICE,)
    )
    parser.submit(int).result()  # its first process is up: a parse waits for nothing else
    return parser


def parse_bounded_json(raw: bytes, max_messages: int | None) -> Any:
    """parse_json, then a `messages` list past the limit refused where it was parsed."""
    value = parse_json(raw)
    if isinstance(value, dict) and isinstance(messages := value.get("messages"), list):
        check_message_count(messages, max_messages)
    return value


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, refused (400) when malformed or nested past MAX_JSON_DEPTH."""
    try:
        # Strict UTF-8 (what the OpenAI API takes), decoded here: json.loads(bytes) would decode
        # surrogate bytes (ED A0 80) with "surrogatepass", and would accept UTF-16 and UTF-32.
        # A UTF-8 byte-order mark is dropped, as json.loads(bytes) drops it.
        text = raw.decode("utf-8-sig")
        value = json.loads(text)
    except RecursionError:  # json's C decoder recurses once per level
        raise _too_deep() from None
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"the request body is not valid JSON: it is not UTF-8 (at byte {exc.start})",
            code="invalid_json",
        ) from None
    except ValueError:  # also covers ints past Python's 4,300 digits
        raise InvalidRequestError(
            "the request body is not valid JSON", code="invalid_json"
        ) from None
    # Nesting past the limit needs more brackets than that in all: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _nests_deeper(value, MAX_JSON_DEPTH):
        raise _too_deep()
    # JSON may spell a lone surrogate ("\ud800"), which is no Unicode text: the tokenizer, UTF-8
    # and msgpack all refuse it, wherever in the body it reached them. Only an escape makes one
    # (strict UTF-8 has no bytes for one).
    if _SURROGATE_ESCAPE.search(raw) and (where := _lone_surrogate(value)) is not None:
        path, char = where
        raise InvalidRequestError(
            f"{path} holds a lone surrogate (U+{ord(char):04X}), which is not valid Unicode",
            param=path,
        )
    return value


def _lone_surrogate(value: Any) -> tuple[str, str] | None:
    """(path, the surrogate) of a string or key holding one; json.loads has joined valid pairs."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if found := _SURROGATE.search(node):
                return path or "body", found.group()
        elif isinstance(node, dict):
            for key, child in node.items():
                name = key if len(key) <= 40 else f"{key[:40]}..."
                where = f"{path}.{name}" if path else name
                if found := _SURROGATE.search(key):
                    return where, found.group()
                if isinstance(child, str | dict | list):
                    stack.append((child, where))
        elif isinstance(node, list):
            stack.extend(
                (child, f"{path}[{i}]")
                for i, child in enumerate(node)
                if isinstance(child, str | dict | list)
            )
    return None


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests past `limit`, level by level (recursing would be the problem)."""
    level = [value] if isinstance(value, dict | list) else []
    for _ in range(limit):
        if not level:
            return False
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, dict | list)
        ]
    return bool(level)


def _too_deep() -> InvalidRequestError:
    return InvalidRequestError(
        f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
    )
