"""The two-sided link's rank table: every accepted form and every refusal, table-driven."""

from __future__ import annotations

import json
from typing import Any

import pytest

from aiodatadist._ranktable import parse_rank_table
from aiodatadist.errors import LLMParamError, LLMStatusCode


def _table(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": "1.0",
        "server_count": "2",
        "status": "completed",
        "server_list": [
            {
                "server_id": "10.0.0.1",
                "device": [{"device_id": "0", "device_ip": "192.168.1.1", "rank_id": "0"}],
            },
            {
                "server_id": "10.0.0.2",
                "device": [{"device_id": "1", "device_ip": "192.168.1.2", "rank_id": "1"}],
            },
        ],
    }
    doc.update(over)
    return doc


def _v12(with_pods: bool) -> dict[str, Any]:
    doc = _table(version="1.2")
    for i, server in enumerate(doc["server_list"]):
        server["device"][0]["super_device_id"] = str(i)
    if with_pods:
        doc["super_pod_list"] = [
            {"super_pod_id": "0", "server_list": [{"server_id": "10.0.0.1"}]},
            {"super_pod_id": "1", "server_list": [{"server_id": "10.0.0.2"}]},
        ]
    return doc


def _one_server() -> dict[str, Any]:
    # vllm-ascend merges both devices into one server entry on one host.
    return {
        "version": "1.2",
        "server_count": "1",
        "status": "completed",
        "server_list": [
            {
                "server_id": "10.0.0.1",
                "device": [
                    {"device_id": "0", "device_ip": "1.1.1.1", "rank_id": "0"},
                    {"device_id": "1", "device_ip": "1.1.1.2", "rank_id": "1", "x": 1},
                ],
            }
        ],
        "unknown_top_level": {"ignored": True},
    }


VALID = {
    "v1.0": (_table(), {0, 1}),
    "v1.2": (_v12(False), {0, 1}),
    "v1.2-super-pods": (_v12(True), {0, 1}),
    "one-server-two-devices": (_one_server(), {0, 1}),
    "int-ids-no-server-count": (
        {
            "version": "1.0",
            "server_list": [
                {
                    "server_id": "h",
                    "device": [{"device_id": 3, "rank_id": 7}, {"device_id": 4, "rank_id": 2}],
                }
            ],
        },
        {7, 2},
    ),
}


@pytest.mark.parametrize("name", list(VALID))
def test_accepted_tables(name: str) -> None:
    doc, ranks = VALID[name]
    table = parse_rank_table(json.dumps(doc))
    assert table.version == doc["version"]
    assert set(table.ranks) == ranks
    for rank, entry in table.ranks.items():
        assert entry.rank_id == rank and entry.listen is None


def test_listen_ip_info_extension() -> None:
    doc = _table()
    doc["server_list"][1]["device"][0]["listen_ip_info"] = "127.0.0.1:26000"
    table = parse_rank_table(json.dumps(doc))
    assert table.ranks[1].listen == ("127.0.0.1", 26000)
    assert table.ranks[0].listen is None
    assert table.ranks[1].server_id == "10.0.0.2" and table.ranks[1].device_id == "1"


def _mutate(fn: Any) -> str:
    doc = _table()
    fn(doc)
    return json.dumps(doc)


def _dev(doc: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = doc["server_list"][0]["device"][0]
    return d


INVALID: dict[str, tuple[str, str]] = {
    "not-json": ("{not json", "not JSON"),
    "not-an-object": ("[1, 2]", "must be an object"),
    "version-missing": (_mutate(lambda d: d.pop("version")), "version"),
    "version-2.0": (_mutate(lambda d: d.update(version="2.0")), "version"),
    "version-number": (_mutate(lambda d: d.update(version=1.0)), "version"),
    "no-server-list": (_mutate(lambda d: d.pop("server_list")), "server_list"),
    "server-list-not-list": (_mutate(lambda d: d.update(server_list={})), "server_list"),
    "server-not-object": (
        _mutate(lambda d: (d["server_list"].append("x"), d.pop("server_count"))),
        r"server_list\[2\] must be an object",
    ),
    "server-no-id": (_mutate(lambda d: d["server_list"][0].pop("server_id")), "server_id"),
    "server-no-device": (_mutate(lambda d: d["server_list"][0].pop("device")), "device"),
    "device-not-list": (_mutate(lambda d: d["server_list"][0].update(device={})), "device"),
    "no-rank-id": (_mutate(lambda d: _dev(d).pop("rank_id")), "rank_id"),
    "no-device-id": (_mutate(lambda d: _dev(d).pop("device_id")), "device_id"),
    "rank-id-text": (_mutate(lambda d: _dev(d).update(rank_id="zero")), "rank_id"),
    "rank-id-negative": (_mutate(lambda d: _dev(d).update(rank_id=-1)), "rank_id"),
    "rank-id-too-big": (_mutate(lambda d: _dev(d).update(rank_id=2**32)), "uint32"),
    "rank-id-bool": (_mutate(lambda d: _dev(d).update(rank_id=True)), "rank_id"),
    "duplicate-rank": (_mutate(lambda d: _dev(d).update(rank_id="1")), "appears twice"),
    "server-count-wrong": (_mutate(lambda d: d.update(server_count="3")), "server_count"),
    "server-count-text": (_mutate(lambda d: d.update(server_count="two")), "server_count"),
    "super-pods-not-list": (_mutate(lambda d: d.update(super_pod_list={})), "super_pod_list"),
    "super-pod-no-id": (
        _mutate(lambda d: d.update(super_pod_list=[{"server_list": []}])),
        "super_pod_id",
    ),
    "super-pod-no-servers": (
        _mutate(lambda d: d.update(super_pod_list=[{"super_pod_id": "0"}])),
        "server_list",
    ),
    "super-pod-unknown-server": (
        _mutate(
            lambda d: d.update(
                super_pod_list=[{"super_pod_id": "0", "server_list": [{"server_id": "9.9.9.9"}]}]
            )
        ),
        "9.9.9.9",
    ),
    "super-pod-server-no-id": (
        _mutate(lambda d: d.update(super_pod_list=[{"super_pod_id": "0", "server_list": [{}]}])),
        "server_id",
    ),
    "listen-ip-info-bad": (
        _mutate(lambda d: _dev(d).update(listen_ip_info="localhost")),
        "listen_ip_info",
    ),
    "listen-ip-info-port-0": (
        _mutate(lambda d: _dev(d).update(listen_ip_info="127.0.0.1:0")),
        "listen_ip_info",
    ),
    "listen-ip-info-not-str": (
        _mutate(lambda d: _dev(d).update(listen_ip_info=26000)),
        "listen_ip_info",
    ),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_refused_tables(name: str) -> None:
    text, words = INVALID[name]
    with pytest.raises(LLMParamError, match=words) as info:
        parse_rank_table(text)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert isinstance(info.value, ValueError)


def test_not_a_string_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="rank_table must be str"):
        parse_rank_table(_table())  # type: ignore[arg-type]


def test_every_member_rank_must_be_in_the_table() -> None:
    table = parse_rank_table(json.dumps(_table()))
    table.check_ranks({10: 0, 11: 1})
    with pytest.raises(LLMParamError, match=r"no rank 5 \(cluster 11"):
        table.check_ranks({10: 0, 11: 5})
