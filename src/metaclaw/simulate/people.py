"""`People`: several people talking to the live service (`train.py rollout=proxy`) the way users do.

Unlike `SimulatedUser` (the demo), a person sends no session headers and no agent id, asks the proxy's model
from `/v1/models`, sets no temperature, and uses the plain `openai` client (a share of conversations goes
through the `anthropic` SDK on `/v1/messages`). A conversation is three questions and a closing reaction:

    Q1 → A1;  reaction to A1 + Q2 → A2;  reaction to A2 + Q3 → A3;  reaction to A3 alone → A4

Feedback is only ever in the next message: praise when the reply complies with the person's hidden
preference, a correction otherwise, drawn from the phrasing pools of `people.yaml` (never the rule judge's
words). A4 is the turn nothing reacts to. At `machine` pace the next message goes as soon as the reply
arrives; at `human` pace a person reads and types first (seconds), and pauses between conversations.

Every turn is recorded (`turns`: the reply, whether it complied, the reaction, the message that carried it),
so a bench can check from the store how each reaction was trained; every request's header names are counted
(`headers`) so it can show that no session header was ever sent. The people run on the one simulated-people
driver (`metaclaw.simulate.driver.Driver`), as the main job's `SimulatedUser` does.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import yaml

from metaclaw.simulate.driver import Driver
from metaclaw.simulate.preferences import PreferenceSet
from metaclaw.simulate.tasks import Task, load_tasks
from metaclaw.wire.client import Endpoint, openai_client

log = logging.getLogger(__name__)

POOLS = Path(__file__).with_name("people.yaml")
PHRASINGS = ("train", "heldout", "all")
PACES = ("machine", "human")
SESSION_HEADERS = ("x-session-id", "x-turn-type", "x-session-done", "x-agent-id")
JOINERS = ("\n\n", " ", "\n", "\n\nAlso, ", " Next: ", " Anyway. ", " Another one: ", "\n\nok, ")


@cache
def _pools() -> dict[str, Any]:
    return yaml.safe_load(POOLS.read_text())


def phrasings() -> dict[str, list[str]]:
    """Every phrasing of `people.yaml` by what it says: `praise` (shared and each kind's) and `correction`."""
    pools = _pools()
    praise = list(pools["praise"]) + [p for k in pools["kinds"].values() for p in k["praise"]]
    return {"praise": praise, "correction": [p for k in pools["kinds"].values() for p in k["correction"]]}


def kinds() -> tuple[str, ...]:
    """The preference kinds people can hold (`people.yaml`)."""
    return tuple(_pools()["kinds"])


def _split(phrases: list[str], phrasings: str) -> list[str]:
    """Every 5th phrasing is held out (`heldout`); `train` is the rest; `all` both."""
    if phrasings == "all":
        return list(phrases)
    return [p for i, p in enumerate(phrases) if (i % 5 == 4) == (phrasings == "heldout")]


@dataclass(frozen=True)
class PreferenceKind:
    """A hidden preference a person holds: its verifier, and how the person praises and corrects."""

    name: str
    want: str
    rules: list[dict[str, Any]]
    praise: list[str]
    correction: list[str]
    openings: tuple[str, ...] = ()  # a conversation opens with one of these half the time (none: a task always)

    @classmethod
    def load(cls, name: str, phrasings: str = "train") -> PreferenceKind:
        pools = _pools()
        if name not in pools["kinds"]:
            raise ValueError(f"unknown preference kind {name!r}: one of {', '.join(kinds())}")
        if phrasings not in PHRASINGS:
            raise ValueError(f"phrasings must be one of {PHRASINGS}, got {phrasings!r}")
        k = pools["kinds"][name]
        praise = _split(pools["praise"], phrasings) + _split(k["praise"], phrasings)
        openings = tuple(_split(k.get("openings", []), phrasings))
        return cls(name, k["want"], k["rules"], praise, _split(k["correction"], phrasings), openings)

    @property
    def verifier(self) -> PreferenceSet:
        return PreferenceSet(self.rules)


@dataclass
class Turn:
    """One reply as a person met it: did it comply, and the message that carried the reaction (None: A4)."""

    person: int
    conversation: str
    index: int
    sdk: str
    reply: str
    complied: bool
    reaction: str | None  # praise | correction | None (the closing turn: nothing reacted)
    next_message: str | None
    sent_at: float
    replied_at: float


class PeopleClients:
    """The `openai` and `anthropic` clients people make (their own HTTP clients), counting every request's header
    names (`headers`) and asking the model the proxy serves (`/v1/models`), as a client does."""

    def __init__(self, base_url: str, api_key: str | None, max_tokens: int, timeout_s: float) -> None:
        self.endpoint = Endpoint(base_url, api_key)  # with or without /v1: the SDKs get the form each wants
        self.base_url, self.api_key = self.endpoint.v1, api_key
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self.headers: Counter[str] = Counter()  # header name -> requests that carried it
        self.requests = 0
        self.model: str | None = None
        self._lock = threading.Lock()
        self._http: list[Any] = []  # one client per SDK and person, each with the hook that counts headers

    def _seen(self, request: Any) -> None:
        with self._lock:
            self.requests += 1
            self.headers.update({name.lower() for name in request.headers})

    @property
    def session_headers_sent(self) -> int:
        """Requests that carried a session header (`X-Session-Id`, ...): 0 for people."""
        return sum(self.headers[h] for h in SESSION_HEADERS)

    def make(self) -> tuple[Any, Any]:
        """An `openai` and an `anthropic` client, as a user makes them (their own HTTP clients, header hook)."""
        import httpx2
        from anthropic import Anthropic

        key = self.api_key or "none"
        hooks = {"request": [self._seen]}
        oa_http = httpx.Client(timeout=self.timeout_s, event_hooks=hooks)
        an_http = httpx2.Client(timeout=self.timeout_s, event_hooks=hooks)  # the anthropic SDK's httpx
        with self._lock:
            self._http += [oa_http, an_http]
        oa = openai_client(self.endpoint, self.timeout_s, max_retries=0, http_client=oa_http)
        an = Anthropic(base_url=self.endpoint.root, api_key=key, http_client=an_http, max_retries=0)
        return oa, an

    def discover(self) -> None:
        """Ask the proxy which model it serves (as a client would)."""
        oa, _ = self.make()
        self.model = oa.models.list().data[0].id

    def ask(self, clients: tuple[Any, Any], sdk: str, messages: list[dict[str, str]]) -> str:
        oa, an = clients
        if sdk == "openai":
            out = oa.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens)
            return out.choices[0].message.content or ""
        out = an.messages.create(model=self.model, messages=messages, max_tokens=self.max_tokens)
        return "".join(getattr(b, "text", "") for b in out.content)

    def close(self) -> None:
        with self._lock:
            clients, self._http = self._http, []
        for client in clients:
            client.close()


class People:
    """`people` people, each on its own thread, talking to the proxy at `base_url` (`.../v1`) until `stop()`.

    Args:
        base_url: the proxy's OpenAI base URL, as its log prints it.
        kind: the hidden preference every person holds.
        people: how many people talk at once.
        pace: `machine` (the next message as soon as the reply arrives) or `human` (reading and typing time);
            a list gives each person their own.
        api_key: the proxy's key, if it has one.
        anthropic_share: share of conversations through the `anthropic` SDK.
        max_tokens: what the client asks per reply.
        think_s / pause_s: human pace: seconds before each message / between conversations (uniform ranges).
        timeout_s: per request.
        seed: question and phrasing choice.
        max_conversations: each person stops after this many (None: until `stop()`).
    """

    def __init__(
        self,
        base_url: str,
        kind: PreferenceKind,
        people: int = 2,
        pace: str | list[str] = "machine",
        api_key: str | None = None,
        anthropic_share: float = 0.25,
        max_tokens: int = 48,
        think_s: tuple[float, float] = (8.0, 30.0),
        pause_s: tuple[float, float] = (30.0, 120.0),
        timeout_s: float = 300.0,
        seed: int = 0,
        max_conversations: int | None = None,
    ) -> None:
        paces = [pace] * people if isinstance(pace, str) else list(pace)
        if people < 1 or len(paces) != people or any(p not in PACES for p in paces):
            raise ValueError(f"people: need >= 1 person and a pace in {PACES} for each, got {people} / {pace!r}")
        self.kind, self.paces, self.verifier = kind, paces, kind.verifier
        self.tasks: list[Task] = load_tasks(None, "train")
        self.anthropic_share, self.think_s, self.pause_s = anthropic_share, think_s, pause_s
        self.clients = PeopleClients(base_url, api_key, max_tokens, timeout_s)
        self.turns: list[Turn] = []
        self._lock = threading.Lock()
        self._mine: dict[int, tuple[Any, Any]] = {}  # each person's clients
        self.driver = Driver("person", people, self._converse, seed, max_conversations, per_worker=True,
                             pause=lambda person, rng: self._think(person, rng, self.pause_s), retry_s=2.0)  # fmt: skip

    @property
    def headers(self) -> Counter[str]:
        """Header name -> requests that carried it."""
        return self.clients.headers

    @property
    def requests(self) -> int:
        return self.clients.requests

    @property
    def session_headers_sent(self) -> int:
        """Requests that carried a session header (`X-Session-Id`, ...): 0 for people."""
        return self.clients.session_headers_sent

    # ---- one conversation ------------------------------------------------------------------------------------
    def reaction(self, rng: random.Random, complied: bool, question: str | None) -> str:
        """The person's next message: praise or a correction, then the next question (alone on the last turn)."""
        text = rng.choice(self.kind.praise if complied else self.kind.correction)
        return text if question is None else f"{text}{rng.choice(JOINERS)}{question}"

    def _converse(self, person: int, rng: random.Random, number: int) -> None:
        if person not in self._mine:
            self._mine[person] = self.clients.make()
        self.conversation(person, rng, self._mine[person], number)

    def conversation(self, person: int, rng: random.Random, clients: tuple[Any, Any], number: int) -> None:
        sdk = "anthropic" if rng.random() < self.anthropic_share else "openai"
        questions: list[str | None] = [t.prompt for t in rng.sample(self.tasks, 3)] + [None]
        if self.kind.openings and rng.random() < 0.5:  # people say hello first (drawn only for kinds that do)
            questions[0] = rng.choice(self.kind.openings)
        messages = [{"role": "user", "content": questions[0]}]
        cid = f"p{person}-c{number}"
        for i in range(4):
            if self.driver.stopping.is_set():
                return
            sent = time.time()
            reply = self.clients.ask(clients, sdk, messages)
            complied = not self.verifier.check(reply)
            nxt = None if i == 3 else self.reaction(rng, complied, questions[i + 1])
            reaction = None if i == 3 else ("praise" if complied else "correction")
            with self._lock:
                self.turns.append(Turn(person, cid, i, sdk, reply, complied, reaction, nxt, sent, time.time()))
            if nxt is None:
                return
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": nxt}]
            self._think(person, rng, self.think_s)

    def _think(self, person: int, rng: random.Random, span: tuple[float, float]) -> None:
        if self.paces[person] == "human":
            self.driver.stopping.wait(rng.uniform(*span))

    # ---- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> People:
        """Ask the proxy which model it serves (as a client would), then start every person."""
        self.clients.discover()
        self.driver.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self.driver.join(timeout)

    def stop(self, timeout: float = 120.0) -> None:
        """No new message after the one in flight; waits up to `timeout` for it."""
        self.driver.stop(timeout)
        self.clients.close()

    def summary(self) -> dict[str, Any]:
        """Counts of what the people saw and said, and the header names they sent."""
        figures = self.driver.figures()
        with self._lock:
            turns = list(self.turns)
        reacted = [t for t in turns if t.reaction]
        return {
            "people": len(self.paces),
            "paces": self.paces,
            "preference": self.kind.name,
            "want": self.kind.want,
            "conversations": len({t.conversation for t in turns}),
            "replies": len(turns),
            "reacted": len(reacted),
            "complied": sum(t.complied for t in reacted),
            "corrected": sum(t.reaction == "correction" for t in reacted),
            "anthropic_replies": sum(t.sdk == "anthropic" for t in turns),
            "requests": self.requests,
            "request_headers": dict(sorted(self.headers.items())),
            "session_headers_sent": self.session_headers_sent,
            "errors": figures["errors"],
            "first_errors": self.driver.first_errors[:3],
        }

    def turn_records(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(t) for t in self.turns]
