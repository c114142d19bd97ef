"""The private parts of uvicorn that the HTTP fast path (``fast_protocol.py``) and the
slow-client protocol (``slow_clients.py``) build on, pinned by name and signature.

pyproject.toml pins uvicorn to the tested minor release; this test is what fails first
(and says what moved) when that pin is raised onto a release whose ``httptools_impl``
changed the callbacks, attributes or cycle fields those subclasses rely on.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap

import uvicorn
from uvicorn.protocols.http import httptools_impl
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.server import ServerState

from kiln.frontends.http.fast_protocol import _FastCycle

# The callbacks kiln overrides or calls, with the parameters it passes.
METHODS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "data_received": ["self", "data"],
    "on_message_begin": ["self"],
    "on_header": ["self", "name", "value"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
    "send_400_response": ["self", "msg"],
}

# What uvicorn's protocol reads or writes on ``self.cycle``; a _FastCycle stands there
# while a fast request is in flight, so every name here was checked against it.
CYCLE_FIELDS = {
    "body",
    "disconnected",
    "keep_alive",
    "message_event",
    "more_body",
    "response_complete",
}


def _methods(cls_: type = HttpToolsProtocol) -> dict[str, ast.FunctionDef]:
    source = textwrap.dedent(inspect.getsource(cls_))
    cls = ast.parse(source).body[0]
    assert isinstance(cls, ast.ClassDef)
    return {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}


def _self_assigned(fn: ast.FunctionDef) -> set[str]:
    return {
        t.attr
        for node in ast.walk(fn)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def test_the_overridden_and_called_methods_keep_their_signatures() -> None:
    for name, params in METHODS.items():
        method = getattr(HttpToolsProtocol, name)
        assert list(inspect.signature(method).parameters) == params, name


def test_the_protocol_state_the_fast_path_reads_is_still_there() -> None:
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(lambda scope, receive, send: None, http="httptools")
        protocol = HttpToolsProtocol(config, ServerState(), {}, _loop=loop)
    finally:
        loop.close()
    for attr in ("parser", "cycle", "expect_100_continue", "limit_concurrency", "loop"):
        assert hasattr(protocol, attr), attr
    assert protocol.cycle is None
    assert protocol.connections is protocol.server_state.connections
    assert protocol.tasks is protocol.server_state.tasks
    assert isinstance(protocol.server_state.default_headers, list)
    for name in ("get_method", "get_http_version", "should_keep_alive"):
        assert callable(getattr(protocol.parser, name)), name
    methods = _methods()
    assert {"transport", "flow"} <= _self_assigned(methods["connection_made"])
    assert {"url", "headers"} <= _self_assigned(methods["on_message_begin"])
    assert "write_paused" in _self_assigned(_methods(FlowControl)["__init__"])
    assert inspect.iscoroutinefunction(FlowControl.drain)


def test_status_lines_are_preformatted_for_every_code() -> None:
    assert STATUS_LINE is httptools_impl.STATUS_LINE
    assert STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"
    assert STATUS_LINE[431] == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    assert set(STATUS_LINE) == set(range(100, 600))


def test_uvicorn_touches_only_the_cycle_fields_a_fast_cycle_was_checked_against() -> None:
    used: set[str] = set()
    for fn in _methods().values():
        for node in ast.walk(fn):
            # self.cycle.X, and existing_cycle.X (the previous self.cycle)
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            if (
                isinstance(inner, ast.Attribute)
                and inner.attr == "cycle"
                and isinstance(inner.value, ast.Name)
                and inner.value.id == "self"
            ) or (isinstance(inner, ast.Name) and inner.id == "existing_cycle"):
                used.add(node.attr)
    assert used == CYCLE_FIELDS
    # A _FastCycle has all of them but ``more_body``, which uvicorn writes only after
    # finding ``response_complete`` false: never for a fast request, whose body kiln reads.
    fast = set(_FastCycle.__slots__) | {"message_event"}
    assert CYCLE_FIELDS - fast == {"more_body"}
