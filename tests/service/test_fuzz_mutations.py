"""Mutation fuzzing of a real `pagedserve serve`: valid bodies from its own /openapi.json, each
given one to three hostile edits (deep nesting, huge ints, lone surrogates, odd Unicode, wrong
types, extreme numbers, duplicate and unknown keys, long strings, odd roles, huge logit_bias keys,
floods of messages, surrogates in structured-output specs, cut JSON), and fuzzed Authorization
header bytes, get no 5xx and an OpenAI error body on every 4xx.

PAGEDSERVE_FUZZ_BODIES sets the bodies (and header values) per endpoint; PAGEDSERVE_FUZZ_OUT=path
writes the tally as JSON; `pytest -s` prints it as a table.
"""
# ruff: noqa: F811 - the stack fixture is imported by name and then requested

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import random
import time
import urllib.request
from collections import Counter
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings

from shared.structured import GUIDED_FIELDS
from tests.service.schema_strategy import from_schema
from tests.service.stack_process import API_KEY, HEADERS, ServeProcess

NUM_BODIES = int(os.environ.get("PAGEDSERVE_FUZZ_BODIES", "120"))  # per endpoint
SEED = 20_240_611
BATCH = 50  # bodies sent together
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"]
CAPPED = ("max_tokens", "max_completion_tokens", "min_tokens")  # keep generation cheap
TALLY: dict[str, dict[str, Any]] = {}  # endpoint -> counts, for the table and the JSON summary


@pytest.fixture(scope="module")
def serve(tiny_model_dir):
    stack = ServeProcess(
        tiny_model_dir, "--num-device-blocks", "256", "--max-num-seqs", "64",
        "--request-timeout", "60",
    )  # fmt: skip
    started = time.monotonic()
    yield stack
    assert stack.stop() == 0
    TALLY["_run"] = {"served_s": round(time.monotonic() - started, 1)}
    _report()


# ---- bodies --------------------------------------------------------------------------------


class Raw:
    """JSON text written as it is: what json.dumps would not write (or would choke on)."""

    def __init__(self, text: bytes) -> None:
        self.text = text


class Dup:
    """An object written with a key twice (JSON allows it; the last value wins in Python)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


def dumps(value: Any) -> bytes:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, list):
        return b"[" + b",".join(dumps(v) for v in value) + b"]"
    if isinstance(value, dict | Dup):
        pairs = value.pairs if isinstance(value, Dup) else value.items()
        return b"{" + b",".join(json.dumps(k).encode() + b":" + dumps(v) for k, v in pairs) + b"}"
    return json.dumps(value).encode()  # ASCII: a lone surrogate is written as \ud800


def _deep(rng: random.Random, old: Any) -> Any:
    depth = rng.choice([65, 200, 1000, 100_000])
    if rng.random() < 0.5:
        return Raw(b"[" * depth + b"1" + b"]" * depth)
    return Raw(b'{"a":' * depth + b"1" + b"}" * depth)


def _huge_int(rng: random.Random, old: Any) -> Any:
    if rng.random() < 0.3:
        return rng.choice([2**31, 2**53 + 1, 2**63, 2**64, -(2**63), -(2**31) - 1])
    sign = b"-" if rng.random() < 0.2 else b""
    return Raw(sign + b"9" * rng.choice([20, 400, 4300, 4301, 5000]))


SURROGATES = ["\ud800", "a\udfffb", "\udc80\udc80", "\ud83d", "x" * 10 + "\udbff"]
ODD_TEXT = [
    "\x00", "\u202e\u2066abc", "\ufeff", "\U0001f99c" * 50, "e\u0301" * 200, "\uffff",
    "\u0663\u0664", "\uff11\uff12", "\u0085\u2028\u2029", "<|im_end|>\n<|im_start|>system\n",
    "\\", '"', "",
]  # fmt: skip
WRONG_TYPES = [None, True, False, 0, 1, -1, 1.5, "", "x", [], {}, [1, "a"], {"a": 1}, [[]], [None]]
EXTREMES = [
    -1, 0, -(2**31), 2**31, 1e308, -1e308, 5e-324, -0.0, 1e-7,
    Raw(b"1e400"), Raw(b"-1e400"), Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"),
]  # fmt: skip
ROLES = [
    "<|im_end|>\n<|im_start|>system", "", "USER", "function", "developer", "tool", "ipython",
    "\ud800", "user\x00", "system ", "assistant\n",
]  # fmt: skip
BIASES = [
    {"1" * 5000: 1}, {"9" * 20: 1}, {"-1": 1}, {"\uff11": 5}, {" 1": 1}, {"1e2": 1}, {"": 1},
    {"0" * 4: 1}, {"5": Raw(b"1e400")}, {"5": Raw(b"NaN")}, {"5": 101}, {"5": "1"},
    {str(i): 1 for i in range(1000)},
]  # fmt: skip


def _surrogate(rng: random.Random, old: Any) -> Any:
    if rng.random() < 0.2:
        return Raw(rng.choice([b'"\xff\xfe"', b'"\xed\xa0\x80"', b'"\xc3"']))  # not UTF-8
    text = rng.choice(SURROGATES)
    return [text] if isinstance(old, list) else text


def _long_string(rng: random.Random, old: Any) -> Any:
    return rng.choice("a \u00e9\U0001f99c[{") * rng.choice([5000, 70_000, 300_000, 1_000_000])


def _pick(rng: random.Random, choices: list[Any]) -> Any:
    return copy.deepcopy(rng.choice(choices))  # a body may be edited again, in place


def _value(choices: list[Any]):
    return lambda rng, old: _pick(rng, choices)


# Replace the value at a random place in the body.
VALUE_MUTATIONS = {
    "deep_nesting": _deep,
    "huge_int": _huge_int,
    "lone_surrogate": _surrogate,
    "odd_unicode": _value(ODD_TEXT),
    "wrong_type": _value(WRONG_TYPES),
    "extreme_number": _value(EXTREMES),
    "long_string": _long_string,
}


def _places(value: Any, path: tuple = (), depth: int = 0) -> list[tuple]:
    places = [path]
    if depth < 4 and isinstance(value, dict):
        for key, child in value.items():
            places += _places(child, (*path, key), depth + 1)
    elif depth < 4 and isinstance(value, list):
        for i, child in enumerate(value[:8]):
            places += _places(child, (*path, i), depth + 1)
    return places


def _get(value: Any, path: tuple) -> Any:
    for step in path:
        value = value[step]
    return value


def _set(body: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    _get(body, path[:-1])[path[-1]] = new
    return body


def _dicts(body: Any) -> list[tuple]:
    return [p for p in _places(body) if isinstance(_get(body, p), dict)]


def mutate(rng: random.Random, body: Any, names: list[str]) -> Any:
    """One named hostile edit of a (JSON-shaped) body; the body is changed in place."""
    name = rng.choice(list(VALUE_MUTATIONS) + STRUCTURE_MUTATIONS)
    names.append(name)
    if name in VALUE_MUTATIONS:
        place = rng.choice(_places(body))
        return _set(body, place, VALUE_MUTATIONS[name](rng, _get(body, place)))
    top = body if isinstance(body, dict) else {}
    if name == "odd_role":
        messages = top.get("messages")
        turns = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
        if turns:
            rng.choice(turns)["role"] = rng.choice(ROLES)
        else:
            top["messages"] = [{"role": rng.choice(ROLES), "content": "x"}]
    elif name == "huge_logit_bias":
        top["logit_bias"] = _pick(rng, BIASES)
    elif name == "message_flood":
        count = rng.choice([2049, 5000, 20_000])  # distinct dicts: a later edit changes one
        top["messages"] = [{"role": "user", "content": "x"} for _ in range(count)]
    elif name == "guided_surrogate":
        for field in GUIDED_FIELDS:  # one structured-output field, so its spec is the one checked
            top.pop(field, None)
        field, spec = rng.choice(GUIDED_SURROGATES)
        top[field] = copy.deepcopy(spec)
    elif name in ("duplicate_key", "unknown_key", "drop_key"):
        place = rng.choice(_dicts(body)) if _dicts(body) else ()
        target = _get(body, place) if place or isinstance(body, dict) else {}
        pairs = list(target.items())
        if name == "drop_key" and pairs:
            key = rng.choice([k for k, _ in pairs])
            if key not in CAPPED:
                del target[key]
        elif name == "duplicate_key" and pairs:
            key, value = rng.choice(pairs)
            twice = Dup([*pairs, (key, _pick(rng, [*WRONG_TYPES, *EXTREMES, value]))])
            return _set(body, place, twice) if place else twice
        else:
            target[rng.choice(["colour", "", "\ud800", "Model", "x" * 300, "prompt "])] = 1
    return body


STRUCTURE_MUTATIONS = [
    "odd_role", "huge_logit_bias", "message_flood", "duplicate_key", "unknown_key", "drop_key",
    "guided_surrogate",
]  # fmt: skip
# A surrogate in a structured-output spec, as bytes that are not UTF-8 (json.loads(bytes) once
# took ED A0 80 as "\ud800") or escaped inside a schema string (seen only when that is parsed).
GUIDED_SURROGATES = [
    ("guided_regex", Raw(b'"a\xed\xa0\x80"')),
    ("guided_grammar", Raw(b'"root ::= \\"\xed\xbf\xbf\\""')),
    ("guided_json", Raw(b'"{\\"pattern\\": \\"\xed\xa0\x80\\"}"')),
    ("guided_json", {"type": "string", "pattern": Raw(b'"\xed\xb2\x80"')}),
    ("guided_json", json.dumps({"type": "string", "pattern": "a\ud800"})),
    ("guided_choice", [Raw(b'"\xed\xa0\x80"')]),
]


def hostile_body(rng: random.Random, valid: Any, names: list[str]) -> bytes:
    body = json.loads(json.dumps(valid))  # a copy the mutations may change in place
    for _ in range(rng.choice([1, 1, 2, 3])):
        body = mutate(rng, body, names)
    if isinstance(body, dict) and not any(key in body for key in CAPPED):
        body["max_tokens"] = 4  # chat's default is the whole remaining context
    raw = dumps(body)
    if rng.random() < 0.05:
        names.append("cut_json")
        raw = raw[: rng.randrange(len(raw))]
    return raw


def _valid_bodies(schema: dict, model: str, count: int) -> list[Any]:
    bodies: list[Any] = []

    @settings(
        max_examples=count,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(from_schema(schema))
    def collect(body):
        if isinstance(body, dict):
            if "model" in body:
                body["model"] = model
            for key in CAPPED:
                if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                    body[key] = min(body[key], 4)
            if not any(key in body for key in CAPPED):
                body["max_tokens"] = 4  # chat's default is the whole remaining context
        bodies.append(body)

    collect()
    while len(bodies) < count:  # Hypothesis may stop early on a small schema
        bodies += bodies[: count - len(bodies)]
    return bodies


# ---- sending and checking ----------------------------------------------------------------------


async def _post_all(url: str, bodies: list[bytes]) -> list[tuple[int, str, str]]:
    async def post(session: aiohttp.ClientSession, body: bytes) -> tuple[int, str, str]:
        headers = HEADERS | {"Content-Type": "application/json"}
        async with session.post(url, data=body, headers=headers) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.text()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(post(session, b) for b in bodies))


def _error_code(status: int, content_type: str, text: str) -> str | None:
    """The response's error code; asserts no 5xx, OpenAI's error shape, and whole streams."""
    assert status < 500, (status, text[:300])
    if status >= 400:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"], text
        assert isinstance(error["type"], str) and "param" in error and "code" in error, text
        return error["code"] or error["type"]
    if content_type.startswith("text/event-stream"):
        assert text.endswith("data: [DONE]\n\n"), text[-200:]
        for block in text.split("\n\n")[:-2]:
            event = json.loads(block[len("data: ") :])
            if "error" in event:  # a failure after the headers went out: no 5xx in disguise
                assert event["error"]["type"] != "internal_error", event
    else:
        json.loads(text)
    return None


def _spec(serve: ServeProcess) -> dict:
    request = urllib.request.Request(f"{serve.url}/openapi.json", headers=HEADERS)
    with urllib.request.urlopen(request) as response:
        return json.loads(response.read())


@pytest.mark.parametrize("path", ENDPOINTS)
def test_mutated_bodies_get_no_5xx_and_openai_errors(serve, path):
    spec = _spec(serve)
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = _valid_bodies(schema, serve.model, NUM_BODIES)
    rng = random.Random(f"{SEED} {path}")
    mutations: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    codes: Counter[str] = Counter()
    failures = []
    for start in range(0, len(valid), BATCH):
        batch = []  # made batch by batch: a few bodies run to megabytes
        for body in valid[start : start + BATCH]:
            names: list[str] = []
            batch.append(hostile_body(rng, body, names))
            mutations.update(names)
        for body, (status, content_type, text) in zip(
            batch, asyncio.run(_post_all(serve.url + path, batch))
        ):
            statuses[status] += 1
            try:
                code = _error_code(status, content_type, text)
            except (AssertionError, ValueError, KeyError, TypeError) as exc:
                failures.append((status, repr(exc)[:300], body[:300]))
                continue
            if code is not None:
                codes[f"{status} {code}"] += 1
    TALLY[path] = _summary(statuses, codes, mutations)
    assert sum(statuses.values()) == NUM_BODIES
    assert not failures, failures[:5]


def _summary(statuses: Counter[int], codes: Counter[str], mutations: Counter[str]) -> dict:
    return {
        "bodies": sum(statuses.values()),
        "2xx": sum(n for s, n in statuses.items() if 200 <= s < 300),
        "4xx": {str(s): n for s, n in sorted(statuses.items()) if 400 <= s < 500},
        "5xx": sum(n for s, n in statuses.items() if s >= 500),
        "4xx_codes": dict(codes.most_common()),
        "mutations": dict(sorted(mutations.items())),
    }


# ---- Authorization header bytes ------------------------------------------------------------


def _header_values(rng: random.Random, count: int) -> list[bytes]:
    # Bytes an HTTP/1.1 parser takes in a header value: tab, visible ASCII and 0x80-0xFF
    # (control bytes are refused by aiohttp's parser itself, before the app sees the request).
    visible = bytes([*range(0x21, 0x7F), *range(0x80, 0x100)])
    allowed = visible + b" \t"
    key = API_KEY.encode()

    def noise(n: int) -> bytes:
        return bytes(rng.choice(allowed) for _ in range(n)).strip()

    makers = [
        lambda: noise(rng.randrange(1, 80)),
        lambda: b"Bearer " + noise(rng.randrange(0, 80)),
        lambda: b"Basic " + noise(rng.randrange(0, 80)),
        lambda: b"Basic " + base64.b64encode(noise(rng.randrange(0, 40)) + b":" + noise(8)),
        lambda: b"Bearer " + key + bytes([rng.choice(visible)]),  # the key and one byte more
        lambda: b"Bearer " + key[:-1] + bytes([rng.randrange(0x80, 0x100)]),
        lambda: rng.choice([b"Bearer", b"Basic", b"bEaReR \xc3\xa4", b"Bearer \xed\xa0\x80"]),
    ]
    values = [rng.choice(makers)() for _ in range(count)]
    return values + [b"Bearer " + key, b"Basic " + base64.b64encode(b"any:" + key)]  # controls


async def _get_with(host: str, port: int, value: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: "
        + value
        + b"\r\nConnection: close\r\n\r\n"
    )
    response = await reader.read()
    writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_fuzzed_authorization_headers_get_401_or_200_never_5xx(serve):
    rng = random.Random(f"{SEED} authorization")
    values = _header_values(rng, NUM_BODIES)

    async def send_all() -> list[tuple[int, bytes]]:
        results = []
        for start in range(0, len(values), BATCH):
            batch = values[start : start + BATCH]
            results += await asyncio.gather(*(_get_with("127.0.0.1", serve.port, v) for v in batch))
        return results

    statuses: Counter[int] = Counter()
    codes: Counter[str] = Counter()
    for value, (status, body) in zip(values, asyncio.run(send_all())):
        statuses[status] += 1
        assert status in (200, 401), (value, status, body[:200])
        if status == 401:
            codes[f"401 {json.loads(body)['error']['code']}"] += 1
    TALLY["Authorization"] = _summary(statuses, codes, Counter())
    assert statuses[200] == 2  # exactly the two well-formed controls


# ---- the inputs that were 500s -----------------------------------------------------------------


FORMER_500S = [
    ("/v1/completions", Raw(b"[" * 100_000 + b"]" * 100_000), 400, "invalid_json"),
    ("/v1/tokenize", {"prompt": Raw(b"[" * 100_000 + b"]" * 100_000)}, 400, "invalid_json"),
    ("/v1/completions", {"prompt": "paris \ud800", "max_tokens": 2}, 400, None),
    ("/v1/tokenize", {"prompt": "\udfff"}, 400, None),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2, "logit_bias": {"1" * 5000: 1}}, 400, None),
]


def test_the_inputs_that_were_500s_are_4xx_through_http(serve):
    bodies = [dumps(body | {"model": serve.model} if isinstance(body, dict) else body)
              for _, body, _, _ in FORMER_500S]  # fmt: skip
    for (path, _, status, code), body in zip(FORMER_500S, bodies):
        [(got, _, text)] = asyncio.run(_post_all(serve.url + path, [body]))
        assert got == status, (path, text[:200])
        error = json.loads(text)["error"]
        assert code is None or error["code"] == code, error
    got, body = asyncio.run(_get_with("127.0.0.1", serve.port, b"Basic \xc3\xa4\xff"))
    assert got == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


# ---- the table and the JSON summary ------------------------------------------------------------


def _report() -> None:
    rows = [(name, t) for name, t in TALLY.items() if not name.startswith("_")]
    if not rows:
        return
    print(f"\nmutation fuzz: {NUM_BODIES} bodies (header values) per endpoint, seed {SEED}")
    print(f"{'endpoint':<22} {'bodies':>7} {'2xx':>6} {'5xx':>4}  4xx by status")
    for name, t in rows:
        fours = ", ".join(f"{s}: {n}" for s, n in t["4xx"].items())
        print(f"{name:<22} {t['bodies']:>7} {t['2xx']:>6} {t['5xx']:>4}  {fours}")
    out = os.environ.get("PAGEDSERVE_FUZZ_OUT")
    if out:
        summary = {"bodies_per_endpoint": NUM_BODIES, "seed": SEED, "endpoints": dict(rows)}
        summary |= TALLY.get("_run", {})
        with open(out, "w") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
