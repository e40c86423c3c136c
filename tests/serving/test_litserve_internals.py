"""LitServe below its documented API (`metaclaw.serving.litserve_compat`): each test pins one assumption, so a LitServe
upgrade that changes it fails here, by name, instead of the policy server failing at run time."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import queue

import litserve.server
import litserve.specs.openai
from litserve.specs.base import LitSpec
from litserve.utils import ResponseBufferItem

from metaclaw.serving import litserve_compat


def test_a_spec_gets_the_servers_queue_and_buffer_in_setup_and_streams_with_data_streamer():
    spec = LitSpec()
    assert {"request_queue", "response_buffer", "response_queue_id"} <= set(vars(spec))
    setup = inspect.getsource(LitSpec.setup)
    assert "self.response_buffer = server.response_buffer" in setup
    assert "self.request_queue = server._get_request_queue(self.api_path)" in setup
    assert "self.data_streamer = server.data_streamer" in setup
    assert "send_status" in inspect.signature(litserve.server.LitServer.data_streamer).parameters


def test_litserves_own_openai_spec_still_submits_the_way_we_do():
    source = inspect.getsource(litserve.specs.openai)
    assert "ResponseBufferItem(response_queue=q, event=event)" in source
    assert "self.request_queue.put((response_queue_id, uid, time.monotonic(), request_el))" in source
    assert {f.name for f in dataclasses.fields(ResponseBufferItem)} >= {"response_queue", "event"}


def test_submit_puts_the_four_tuple_and_registers_the_response_buffer():
    spec = LitSpec()
    spec.request_queue, spec.response_buffer, spec.response_queue_id = queue.Queue(), {}, 3

    async def go():
        return litserve_compat.submit(spec, {"op": "models", "body": None})

    uid, buffer, event = asyncio.run(go())
    consumer, got_uid, t, payload = spec.request_queue.get_nowait()
    assert (consumer, got_uid, payload) == (3, uid, {"op": "models", "body": None}) and t > 0
    item = spec.response_buffer[uid]
    assert item.response_queue is buffer and item.event is event


def test_the_mcp_flag_exists_and_is_turned_off_without_fastmcp(monkeypatch):
    assert isinstance(litserve.server._MCP_AVAILABLE, bool)
    assert "if _MCP_AVAILABLE:" in inspect.getsource(litserve.server)
    monkeypatch.setattr(litserve.server, "_MCP_AVAILABLE", True)
    monkeypatch.setattr(litserve_compat.importlib.util, "find_spec", lambda name: None)
    assert litserve_compat.disable_broken_mcp() is True
    assert litserve.server._MCP_AVAILABLE is False
