"""Request fixtures in the documented shapes of the clients the proxy meets (written from their public docs):
OpenAI Chat Completions, OpenClaw's list-of-parts transcript, the Anthropic Messages API."""

from __future__ import annotations

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8/5+hHgAHggJ/PchI7wAAAABJRU5ErkJggg=="

# OpenClaw-style tools: anyOf / enum / nested arrays in the parameters
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file from the workspace",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"},
            "range": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "integer"}}]}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "exec", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "mode": {"type": "string", "enum": ["sync", "background"]},
            "env": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "value": {"type": "string"}}}}},
            "required": ["command"]}}},
]  # fmt: skip

# A developer prompt, a user turn, an assistant turn with reasoning and two parallel tool calls, their results.
AGENT_HISTORY = [
    {"role": "developer", "content": "You are a coding agent. Use tools when needed."},
    {"role": "user", "content": "Show me README.md and the git status."},
    {"role": "assistant", "content": None, "reasoning_content": "I need two tools at once.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README.md"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "exec", "arguments": '{"command": "git status"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_a", "content": "# Project\nA readme."},
    {"role": "tool", "tool_call_id": "call_b", "content": "On branch main\nnothing to commit"},
    {"role": "user", "content": "Summarise both."},
]  # fmt: skip

# OpenClaw's transcript shape: list-of-parts content, toolCall / toolResult parts, thinking parts, image parts.
OPENCLAW_HISTORY = [
    {"role": "system", "content": [{"type": "text", "text": "You are OpenClaw."}]},
    {"role": "user", "content": [{"type": "text", "text": "What is in ./notes?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "List the folder."},
        {"type": "toolCall", "id": "tc1", "name": "exec", "arguments": {"command": "ls notes"}},
    ]},
    {"role": "toolResult", "toolCallId": "tc1", "content": [{"type": "text", "text": "a.md\nb.md"}]},
    {"role": "user", "content": [{"type": "text", "text": "Thanks. Open a.md."}]},
]  # fmt: skip


def workspace_system_prompt(n_files: int = 12, words_per_file: int = 400) -> str:
    """An OpenClaw-sized system prompt: instructions plus injected workspace files (far over a small context)."""
    files = "\n\n".join(
        f"## workspace/file_{i}.md\n" + " ".join(f"line{i}_{j} of the notes" for j in range(words_per_file))
        for i in range(n_files)
    )
    return "You are OpenClaw, a personal agent. Follow the workspace files.\n\n" + files
