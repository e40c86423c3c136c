"""The wire vocabulary shared by both sides of the proxy/server boundary: one spelling of every word.

On the vocabulary floor (it imports only `metaclaw.messages` and `metaclaw.distribution`), so `serving/`,
`rollout/`, `scoring/`, `modules/`, `training_server/` and the tools all take their words from here: header names,
the error type and body (`errors`), adapter file names, the auth header; and beside them the one outbound client
(`client`), the one prompt renderer (`render`), the one reply reader (`parsing`), the sampling vocabulary
(`sampling`), the request schemas (`schemas`, `openapi`), message normalisation (`normalize`) and the HTTP
security layer (`security`, `bodies`).
"""

from __future__ import annotations

from typing import Any

ADAPTER_VERSION_HEADER = "x-metaclaw-adapter-version"
"""Response header: the adapter version that produced a completion (the policy server sets it, the proxy reads it)."""

ADAPTER_NAME_HEADER = "x-metaclaw-adapter"
"""Response header of the proxy: the adapter that answered (many agents: each agent's own, docs/agents.md)."""

RESPONSE_ID_HEADER = "x-metaclaw-response-id"
"""Response header of the proxy: the turn's response id (`meta.response_id`), what `/v1/feedback` refers to."""

SESSION_HEADER = "x-metaclaw-session-id"
"""Response header of the proxy: the session a main turn was filed under (derived or the client's own)."""

TURN_HEADER = "x-metaclaw-turn-index"
"""Response header of the proxy: the main turn's index within its session."""

CLIENT_HEADER = "x-metaclaw-client"
"""Request header set inside the proxy (`privacy.access.AgentKeyMiddleware`) for a caller with an agent key: a
digest of that key, which partitions its sessions (explicit ids and derived ones) from every other key's."""

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A PEFT adapter directory's weights file (safetensors only: loading never unpickles)."""

ADAPTER_CONFIG = "adapter_config.json"
"""A PEFT adapter directory's config file."""


class RequestError(ValueError):
    """A client's mistake, answered with a 4xx that names the field.

    Args:
        message: what is wrong, naming the field.
        status: the HTTP status (400 unless said otherwise).
        code: OpenAI's `error.code` (the status when None).
        param: the offending field, OpenAI's `error.param`.
        type_: OpenAI's `error.type`.
    """

    def __init__(
        self, message: str, status: int = 400, code: str | None = None, param: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = message, status, code, param, type_

    def body(self) -> dict[str, Any]:
        """The one error body (`metaclaw.wire.errors.error_body`), `code` the status unless one is named."""
        from metaclaw.wire.errors import error_body

        return error_body(self.message, self.status, self.type, self.code or self.status, self.param)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """`Authorization: Bearer <key>` when a key is set, else no header."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def version_headers(version: int | None) -> dict[str, str]:
    """The adapter-version response header, or none when no adapter answered."""
    return {} if version is None else {ADAPTER_VERSION_HEADER: str(version)}
