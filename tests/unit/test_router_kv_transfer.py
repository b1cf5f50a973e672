"""The bodies of a P/D handoff: the prefill asks for remote decode with one token and no stream,
the decode gets the client's body plus the prefill's params unchanged; a response without params
is refused; the client's body is never changed; the command line's mode rule."""

import pytest

from kvpool.router.cli import mode_error
from kvpool.router.kv_transfer import REMOTE_DECODE, NoTransferParams, decode_body, prefill_body, transfer_params


def test_the_prefill_body_asks_for_remote_decode_of_one_token():
    client = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
              "min_tokens": 5, "temperature": 0.3}  # fmt: skip
    body = prefill_body(client)
    assert body == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "stream": False, "temperature": 0.3,
                    "kv_transfer_params": REMOTE_DECODE}  # fmt: skip
    assert REMOTE_DECODE == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                             "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip
    assert client["max_tokens"] == 50 and "kv_transfer_params" not in client  # untouched
    body["kv_transfer_params"]["remote_host"] = "x"
    assert REMOTE_DECODE["remote_host"] is None  # each body gets its own copy


def test_chat_max_completion_tokens_is_capped_only_where_the_client_used_it():
    assert prefill_body({"messages": [], "max_completion_tokens": 9})["max_completion_tokens"] == 1
    assert "max_completion_tokens" not in prefill_body({"messages": []})
    assert prefill_body({"messages": []})["max_tokens"] == 1


def test_the_decode_body_is_the_clients_plus_the_prefills_params():
    params = {"remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "h", "remote_port": 5600,
              "do_remote_prefill": True, "do_remote_decode": False}  # fmt: skip
    client = {"prompt": "hi", "max_tokens": 50, "stream": True}
    assert decode_body(client, params) == {**client, "kv_transfer_params": params}
    assert "kv_transfer_params" not in client


def test_transfer_params_are_read_from_the_prefill_response():
    params = {"remote_engine_id": "e", "remote_block_ids": [3]}
    assert transfer_params({"choices": [], "kv_transfer_params": params}) is params
    for response, said in (({"choices": []}, "no kv_transfer_params"), ({"kv_transfer_params": None}, "None"),
                           ([1], "not a JSON object")):  # fmt: skip
        with pytest.raises(NoTransferParams, match=said):
            transfer_params(response)


def test_the_command_line_names_one_mode():
    assert mode_error(["http://a"], [], []) is None
    assert mode_error([], ["http://p"], ["http://d"]) is None
    assert "not both" in mode_error(["http://a"], ["http://p"], ["http://d"])
    assert "--prefill needs" in mode_error([], ["http://p"], [])
    assert "--decode needs" in mode_error([], [], ["http://d"])
    assert "at least one" in mode_error([], [], [])
