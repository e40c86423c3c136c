"""Recall and false-flag rate of the secret detector on a corpus it was not built against: detect-secrets' own
plugin tests (github.com/Yelp/detect-secrets, `tests/plugins/*_test.py`).

Every literal `(line, should_flag)` pair of those files' `pytest.mark.parametrize` lists is read with `ast` (never
imported or run); the IP plugin's cases are left out (an IP address is personal data here, not a secret).
A `True` case counts as found when `find_secrets(line)` reports anything; a `False` case as a false flag when it
does. Then each line found is re-sent encoded (zero-width-joined, spaced, fullwidth, hex, base64, a `data:` URL,
a 600+ character Kubernetes-style base64 value, split in two messages) and the share still found is reported.
Get the files with `git clone https://github.com/Yelp/detect-secrets` (or any copy of its `tests/plugins`).

`python bench/studies/secret_recall.py PATH/TO/detect-secrets/tests/plugins [--show-misses]` prints JSON.
"""

from __future__ import annotations

import argparse
import ast
import base64
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "src"), str(REPO)]  # run as `python bench/<kind>/<name>.py`

from bench.harness import add_results_argument, publish  # noqa: E402
from metaclaw.privacy.detect import find_secrets, split_secrets  # noqa: E402

LEFT_OUT = ("ip_public_test.py",)
COLUMNS = ("found", "positives", "flagged", "negatives")
ENCODINGS: dict[str, Callable[[str], list[str]]] = {  # a line as texts an agent might send (several: messages)
    "zero_width": lambda s: ["\u200b".join(s)],
    "spaced": lambda s: [" ".join(s)],
    "fullwidth": lambda s: ["".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)],
    "hex": lambda s: [s.encode().hex()],
    "base64": lambda s: [base64.b64encode(s.encode()).decode()],
    "data_url": lambda s: ["data:text/plain;base64," + base64.b64encode(s.encode()).decode()],
    "k8s_secret_600": lambda s: ["data:\n  blob: " + base64.b64encode(("#\n" * 300 + s).encode()).decode()],
    "split_in_two": lambda s: [s[: len(s) // 2], s[len(s) // 2 :]],
}


def found_in(texts: list[str]) -> bool:
    """Whether the detector finds a secret in one message or across two (`split_secrets`)."""
    return any(find_secrets(t) for t in texts) or bool(split_secrets(texts))


def cases(folder: Path) -> list[tuple[str, str, bool]]:
    """`(plugin file, line, should_flag)` for every literal `(str, bool)` pair in the plugin tests."""
    out = []
    for path in sorted(folder.glob("*_test.py")):
        if path.name in LEFT_OUT:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and len(node.elts) == 2:
                line, flag = node.elts
                literal = isinstance(line, ast.Constant) and isinstance(flag, ast.Constant)
                if literal and isinstance(line.value, str) and isinstance(flag.value, bool):
                    out.append((path.name.removesuffix("_test.py"), line.value, flag.value))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("plugins", type=Path, help="detect-secrets' tests/plugins folder")
    p.add_argument("--show-misses", action="store_true")
    add_results_argument(p)
    args = p.parse_args()
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # found, positives, flagged, negatives
    misses = []
    for plugin, line, flag in cases(args.plugins):
        hit = bool(find_secrets(line))
        row = per[plugin]
        row[1 if flag else 3] += 1
        row[0 if flag else 2] += hit
        if hit != flag:
            misses.append({"plugin": plugin, "line": line, "should_flag": flag})
    found, pos, flagged, neg = (sum(r[i] for r in per.values()) for i in range(4))
    plain = [line for _, line, flag in cases(args.plugins) if flag and find_secrets(line)]
    encoded = {name: round(sum(found_in(enc(x)) for x in plain) / len(plain), 4) for name, enc in ENCODINGS.items()}
    out = {
        "corpus": "detect-secrets tests/plugins (literal parametrize cases)",
        "positives": pos,
        "recall": round(found / pos, 4) if pos else None,
        "negatives": neg,
        "false_flag_rate": round(flagged / neg, 4) if neg else None,
        "encoded_recall": {"of": len(plain), **encoded},
        "per_plugin": {k: dict(zip(COLUMNS, v, strict=True)) for k, v in per.items()},
    }
    if args.show_misses:
        out["misses"] = misses
    publish(__file__, args, out)


if __name__ == "__main__":
    main()
