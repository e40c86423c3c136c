"""How often the served model answers a request that needs a tool with a tool call; prints JSON lines.

    python bench/studies/tool_calls.py                          # the embedded default (smollm2_135m), 3 replies a case
    python bench/studies/tool_calls.py --model tiny --replies 1

Starts `python serve.py` (the policy server, as an agent reaches it) on a free port and sends, through the `openai`
SDK, chat completions that offer two tools (`read_file`, `list_dir`) for requests that only a tool can answer ("Read
the file notes.txt ..."), with and without a system prompt that says to use the tools. A reply counts when the
server parsed a tool call from it (`message.tool_calls`, the format `serve.tool_call_format` picks). Issue 40's
agent test needs one tool call on the embedded default; this is the measurement of whether the model makes any.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, free_port, publish, serving  # noqa: E402
from metaclaw.wire.client import Endpoint, openai_client  # noqa: E402


def _tool(name: str, description: str) -> dict:
    path = {"type": "string", "description": "The path"}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {"path": path}, "required": ["path"]}}}  # fmt: skip


TOOLS = [_tool("read_file", "Read a file from disk and return its text."),
         _tool("list_dir", "List the files in a directory.")]  # fmt: skip
REQUESTS = ["Read the file notes.txt and tell me what it says.", "What is in /etc/hostname? Use the tools.",
            "Please open README.md and summarise it.", "List the files in the current directory."]  # fmt: skip
SYSTEM = "You are a coding agent. Use the tools to read files before you answer."


def measure(url: str, replies: int, max_tokens: int) -> dict:
    client = openai_client(Endpoint(url), timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    cases: dict[str, dict] = {}
    for system in (False, True):
        for text in REQUESTS:
            messages = ([{"role": "system", "content": SYSTEM}] if system else []) + [{"role": "user", "content": text}]
            calls = 0
            for _ in range(replies):
                out = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                     max_tokens=max_tokens, temperature=0.7)  # fmt: skip
                calls += bool(out.choices[0].message.tool_calls)
            cases[f"{'system' if system else 'plain'}: {text}"] = {"replies": replies, "with_tool_call": calls}
    total = sum(c["replies"] for c in cases.values())
    made = sum(c["with_tool_call"] for c in cases.values())
    return {"model": model, "replies": total, "with_tool_call": made, "share": made / total, "cases": cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2_135m")
    p.add_argument("--replies", type=int, default=3, help="replies per request and system-prompt case")
    p.add_argument("--max-tokens", type=int, default=80)
    add_results_argument(p)
    args = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="metaclaw-tools-") as tmp:
        run_dir = Path(tmp)
        cmd = [sys.executable, "serve.py", f"model={args.model}", f"serve.port={port}", f"hydra.run.dir={run_dir}"]
        with serving(cmd, f"{url}/health", run_dir / "server.log", {"METACLAW_API_KEY": ""}, timeout_s=300):
            report = measure(url, args.replies, args.max_tokens)
    publish(__file__, args, report)


if __name__ == "__main__":
    main()
