"""Session hints the router adds to a request (router/hints.py) and the connector reads back
(connector/session_hints.py): the two sides agree, and a bad hint is never a bad request."""

from __future__ import annotations

import json

import pytest

from kvpool.connector.session_hints import BadHint, hint_of
from kvpool.router.hints import keep_hint, parse_duration, request_hint, with_hint
from kvpool.router.kv_transfer import decode_body, prefill_body


@pytest.mark.parametrize("value, seconds", [(30, 30.0), ("30", 30.0), ("45s", 45.0), ("5m", 300.0), ("1h", 3600.0),
                                            (True, None), ("soon", None), (-1, None), (10**6, None)])
def test_durations(value, seconds):
    assert parse_duration(value) == seconds


def test_ttl_from_header_then_cache_control_then_default():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}]}
    assert request_hint("s", {"X-KVPool-TTL": "90"}, body, 5.0)["ttl_s"] == 90.0
    assert request_hint("s", {}, body, 5.0)["ttl_s"] == 3600.0
    assert request_hint("s", {}, {"cache_control": {"type": "ephemeral"}}, 5.0)["ttl_s"] == 300.0
    assert request_hint("s", {}, {"prompt": [1, 2]}, 5.0) == {"session": "s", "ttl_s": 5.0, "end": False}
    assert request_hint("s", {"x-session-end": "true"}, {}, 0.0)["end"] is True


def test_the_hint_is_spliced_into_the_body_and_reads_back_in_the_connector():
    parsed = {"model": "m", "prompt": list(range(50))}
    body = json.dumps(parsed).encode()
    hint = request_hint("sess-1", {"x-kvpool-ttl": "2m"}, parsed, 0.0)
    out = with_hint(body, parsed, hint)
    decoded = json.loads(out)
    assert decoded["prompt"] == list(range(50)) and decoded["model"] == "m"
    assert hint_of(decoded["kv_transfer_params"]).session == "sess-1"
    assert hint_of(decoded["kv_transfer_params"]).ttl_s == 120.0
    assert parsed["kv_transfer_params"] == decoded["kv_transfer_params"]
    assert json.loads(with_hint(b" {}", {}, hint)) == {"kv_transfer_params": {"kvpool": hint}}


def test_a_clients_own_hint_and_params_are_kept():
    own = {"prompt": [1], "kv_transfer_params": {"kvpool": {"session": "mine"}}}
    body = json.dumps(own).encode()
    assert with_hint(body, own, {"session": "router's"}) == body
    other = {"prompt": [1], "kv_transfer_params": {"do_remote_prefill": True}}
    merged = json.loads(with_hint(json.dumps(other).encode(), other, {"session": "s"}))
    assert merged["kv_transfer_params"] == {"do_remote_prefill": True, "kvpool": {"session": "s"}}


def test_pd_bodies_keep_the_hint():
    body = {"prompt": [1], "kv_transfer_params": {"kvpool": {"session": "s", "ttl_s": 1.0, "end": False}}}
    assert prefill_body(body)["kv_transfer_params"]["kvpool"]["session"] == "s"
    assert prefill_body(body)["kv_transfer_params"]["do_remote_decode"] is True
    assert decode_body(body, {"remote_engine_id": "e"})["kv_transfer_params"] == {
        "remote_engine_id": "e", "kvpool": body["kv_transfer_params"]["kvpool"]}
    assert keep_hint({}, {"a": 1}) == {"a": 1}


@pytest.mark.parametrize("params", [{"kvpool": "s"}, {"kvpool": {"session": 3}}, {"kvpool": {"ttl_s": -1}},
                                    {"kvpool": {"ttl_s": "5m"}}, {"kvpool": {"end": "yes"}},
                                    {"kvpool": {"session": "x" * 300}}])
def test_the_connector_names_what_is_wrong_with_a_hint(params):
    with pytest.raises(BadHint):
        hint_of(params)


def test_no_hint():
    assert hint_of(None) is None and hint_of({"do_remote_prefill": True}) is None
    assert hint_of({"kvpool": {}}) is None
