"""PD trust end to end (issue 19), on a prefill instance, a decode instance and a router as
processes (KV over the default connector, zmq, on loopback): a cold pair serves its first
30 concurrent requests; a client's prefill URL is refused and never called; every listening
socket of an instance is on the configured host; a prefill instance restarted on the same
port is used again at once. (Mooncake's ports listen on every interface: pinned by a strict
xfail in tests/unit/test_kv_connector_listeners.py.)

The tests share one fleet and run in file order: the cold-pair test must see it first.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import time

import httpx
import psutil
import pytest

from tests.e2e.test_pd_serve import Fleet, chat_prompt_ids, complete, running_fleet

pytestmark = pytest.mark.slow  # a prefill, a decode and a router, as processes

HOST = "127.0.0.1"
CONCURRENT = 30


@pytest.fixture(scope="module")
def fleet():
    with running_fleet(mtp=False, mixed=False) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from tandem.bench.datasets import load_mtbench

    return chat_prompt_ids(load_mtbench()[:CONCURRENT])


def test_a_cold_pair_serves_its_first_30_concurrent_requests(fleet, prompts):
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(lambda p: complete(fleet.urls["router"], p, False), prompts))
    errors = [r["error"] for r in results if r["error"] is not None]
    assert not errors, f"{len(errors)} of {CONCURRENT} failed, e.g. {errors[0]}"
    assert all(r["token_ids"] for r in results)


def test_a_clients_prefill_url_is_refused_and_never_called(fleet, prompts):
    with socket.socket() as bait:
        bait.bind((HOST, 0))
        bait.listen()
        bait.setblocking(False)
        bait_url = f"http://{HOST}:{bait.getsockname()[1]}"
        for headers in (
            {"x-tandem-prefill-url": bait_url},
            {"x-tandem-prefill-url": bait_url, "x-tandem-prefill-signature": "0" * 64},
        ):
            reply = httpx.post(
                f"{fleet.urls['decode']}/v1/completions",
                json={"prompt": prompts[0], "max_tokens": 2},
                headers=headers,
                timeout=30,
            )
            assert reply.status_code == 403, reply.text
            assert reply.json()["error"]["type"] == "permission_error"
        with pytest.raises(BlockingIOError):
            bait.accept()  # the decode instance never called it
    # The router's requests still go through.
    assert complete(fleet.urls["router"], prompts[0], False)["error"] is None


def _listeners(fleet: Fleet, name: str) -> tuple[list, list]:
    """The listening sockets (ip, port) of an instance's API process and of its children."""
    api = psutil.Process(fleet.procs[name].pid)
    own = [c.laddr for c in api.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    children = [
        c.laddr
        for child in api.children(recursive=True)
        for c in child.net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    return own, children


@pytest.mark.parametrize("name", ["prefill", "decode"])
def test_every_listening_socket_is_on_the_configured_host(fleet, name):
    own, core = _listeners(fleet, name)
    port = int(fleet.urls[name].rsplit(":", 1)[1])
    assert [(a.ip, a.port) for a in own] == [(HOST, port)]  # the HTTP port, on --host
    info = httpx.get(f"{fleet.urls[name]}/v1/disagg/info", timeout=10).json()
    control_port = int(info["control_address"].rsplit(":", 1)[1])
    assert (HOST, control_port) in [(a.ip, a.port) for a in core]
    # The engine core: the control channel, and on the decode side the KV connector's port
    # (a prefill instance's connector listens nowhere).
    assert len(core) == (2 if name == "decode" else 1), core
    assert {a.ip for a in own + core} == {HOST}


def _wait_router_sees(fleet: Fleet, url: str, healthy: bool, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            instances = httpx.get(f"{fleet.urls['router']}/router/instances", timeout=5).json()
            if any(i["url"] == url and i["healthy"] is healthy for i in instances):
                return
        time.sleep(0.2)
    pytest.fail(f"the router never saw {url} {'healthy' if healthy else 'unhealthy'}")


def test_a_prefill_instance_restarted_on_its_port_is_used_again(fleet, prompts):
    url = fleet.urls["prefill"]
    assert complete(fleet.urls["router"], prompts[1], False)["error"] is None
    fleet.signal("prefill", signal.SIGKILL)
    fleet.procs["prefill"].wait(30)
    _wait_router_sees(fleet, url, healthy=False)
    fleet.start("prefill", fleet.args["prefill"], port=int(url.rsplit(":", 1)[1]))
    fleet.wait_healthy("prefill")
    _wait_router_sees(fleet, url, healthy=True)
    # None fails: the decode instance asks the new control address at once.
    for prompt in prompts[:3]:
        result = complete(fleet.urls["router"], prompt, False)
        assert result["error"] is None, result["error"]
