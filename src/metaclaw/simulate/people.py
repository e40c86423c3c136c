"""`People`: several people talking to the live service (`train.py rollout=proxy`) the way users do.

Unlike `SimulatedUser` (the demo), a person sends no session headers and no agent id, asks the proxy's model
from `/v1/models`, sets no temperature, and uses the plain `openai` client (a share of conversations goes
through the `anthropic` SDK on `/v1/messages`). A conversation is three questions and a closing reaction:

    Q1 → A1;  reaction to A1 + Q2 → A2;  reaction to A2 + Q3 → A3;  reaction to A3 alone → A4

Feedback is only ever in the next message: praise when the reply complies with the person's hidden
preference, a correction otherwise, drawn from the phrasing pools of `people.yaml` (never the rule judge's
words). A4 is the turn nothing reacts to. At `machine` pace the next message goes as soon as the reply
arrives; at `human` pace a person reads and types first (seconds), and pauses between conversations.

Real people do not react to every reply (`react_share`), and some react late (`late_share` of their reactions,
`late_s` after the reply: past the proxy's `session_idle_s`, so the turn was already settled; meanwhile the
person starts other conversations and comes back). A reply nobody reacts to is followed by the next question
alone, a follow-up task ("Now a shorter version.") or a correction of the person's own request ("Sorry, I meant
for two people."), drawn from the kind-free pools `followups` and `own_corrections` of `people.yaml`: none is a
verdict on the reply, so none may be trained as one (`human_mode()`: half reacted, a quarter of those late).

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
from metaclaw.simulate.substance import Encoder, Substance
from metaclaw.simulate.tasks import Task, load_tasks
from metaclaw.wire.client import Endpoint, openai_client

log = logging.getLogger(__name__)

POOLS = Path(__file__).with_name("people.yaml")
PHRASINGS = ("train", "heldout", "all")
PACES = ("machine", "human")
SESSION_HEADERS = ("x-session-id", "x-turn-type", "x-session-done", "x-agent-id")
MAX_PARKED = 32
"""Conversations a person leaves open to react late (the bound of `People._parked`; at this many they wait for the
first to come due). Meanwhile they start other conversations, as people do. At machine pace, with `human_mode()`
(an eighth of the replies parked for 330-600 s), a person has about 12 open on average. A bound of 2 (sessions 17-22)
kept each person idle for minutes at a time. Two people then sent 39 turns in the first 10 minutes of a 40-minute
run, against about 250 with every reaction at once, so the bench starved the learner instead of measuring it."""
JOINERS = ("\n\n", " ", "\n", "\n\nAlso, ", " Next: ", " Anyway. ", " Another one: ", "\n\nok, ")


@cache
def _pools() -> dict[str, Any]:
    return yaml.safe_load(POOLS.read_text())


def phrasings() -> dict[str, list[str]]:
    """Every phrasing of `people.yaml` by what it says: `praise` (shared and each kind's) and `correction`."""
    pools = _pools()
    praise = list(pools["praise"]) + [p for k in pools["kinds"].values() for p in k["praise"]]
    corrections = [p for k in pools["kinds"].values() for p in k["correction"]] + list(pools["off_topic"])
    return {"praise": praise, "correction": corrections}


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
    off_topic: tuple[str, ...] = ()  # what a person says to a reply that does not answer them (any kind)

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
        off_topic = tuple(_split(pools["off_topic"], phrasings))
        return cls(name, k["want"], k["rules"], praise, _split(k["correction"], phrasings), openings, off_topic)

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
    reaction: str | None  # praise | correction | followup | own_correction | None (none, or the closing turn)
    next_message: str | None
    sent_at: float
    replied_at: float
    late_s: float = 0.0  # the reaction was sent this long after the reply
    answered: bool = True  # the reply was about its question (`Substance`; True when not checked)


@dataclass
class Parked:
    """A conversation a person left to react late: where it stands and when they come back to it."""

    due: float
    number: int
    sdk: str
    index: int  # the turn whose reply the late message reacts to
    messages: list[dict[str, str]]
    questions: list[str | None]


@dataclass(frozen=True)
class Habits:
    """How a person reacts (`People`'s arguments of these names) and their no-verdict messages (`people.yaml`)."""

    react_share: float = 1.0
    late_share: float = 0.0
    late_s: tuple[float, float] = (330.0, 600.0)
    followups: tuple[str, ...] = ()
    own_corrections: tuple[str, ...] = ()


def human_mode() -> dict[str, Any]:
    """People as they are (issue 42): they react to half the replies, a quarter of those reactions come minutes
    late (after the proxy's 300 s idle bound), and the rest of their next messages carry no verdict."""
    return {"react_share": 0.5, "late_share": 0.25, "late_s": (330.0, 600.0)}


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
        react_share: share of replies the person reacts to (praise or correction); the others are followed by
            the next question alone, a follow-up task or a correction of their own request (no verdict).
        late_share: share of the reactions sent late, `late_s` (a uniform range, seconds) after the reply.
        substance: people also check that a reply answers their question (`metaclaw.simulate.substance`) and
            correct one that does not, whatever its form: a sentence `Encoder` to check with over the people's own
            questions (the benches give `metaclaw.skills.embedding.EmbeddingRanker()`), a `Substance`, or None.
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
        react_share: float = 1.0,
        late_share: float = 0.0,
        late_s: tuple[float, float] = (330.0, 600.0),
        substance: Substance | Encoder | None = None,
    ) -> None:
        if not (0.0 <= react_share <= 1.0 and 0.0 <= late_share <= 1.0 and 0 <= late_s[0] <= late_s[1]):
            raise ValueError(f"people: react_share and late_share in [0, 1], 0 <= late_s, got {react_share}, "
                             f"{late_share}, {late_s}")  # fmt: skip
        pools = _pools()
        self.habits = Habits(
            react_share, late_share, late_s, tuple(pools["followups"]), tuple(pools["own_corrections"])
        )
        self._parked: dict[int, list[Parked]] = {}  # person -> conversations left to react late
        paces = [pace] * people if isinstance(pace, str) else list(pace)
        if people < 1 or len(paces) != people or any(p not in PACES for p in paces):
            raise ValueError(f"people: need >= 1 person and a pace in {PACES} for each, got {people} / {pace!r}")
        self.kind, self.paces, self.verifier = kind, paces, kind.verifier
        self.tasks: list[Task] = load_tasks(None, "train")
        self.substance = (
            substance
            if substance is None or isinstance(substance, Substance)
            else Substance([t.prompt for t in self.tasks], substance)
        )
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
    def reaction(self, rng: random.Random, complied: bool, question: str | None, answered: bool = True) -> str:
        """The person's next message: praise or a correction, then the next question (alone on the last turn).
        A reply that does not answer them gets an off-topic correction, whatever its form."""
        pool = self.kind.off_topic if not answered and self.kind.off_topic else None
        text = rng.choice(pool or (self.kind.praise if complied else self.kind.correction))
        return text if question is None else f"{text}{rng.choice(JOINERS)}{question}"

    def next_message(
        self, rng: random.Random, complied: bool, question: str | None, answered: bool = True
    ) -> tuple[str | None, str | None]:
        """`(what the person says next, what it is)`: a reaction to `react_share` of the replies, otherwise no
        verdict: the next question alone, a follow-up task, or a correction of their own request."""
        if rng.random() < self.habits.react_share:
            pleased = complied and answered
            return self.reaction(rng, complied, question, answered), "praise" if pleased else "correction"
        draw = rng.random()
        if draw < 0.25:
            return rng.choice(self.habits.followups), "followup"
        if draw < 0.45:
            return rng.choice(self.habits.own_corrections), "own_correction"
        return question, None  # the next question alone (None on the last turn: the person just leaves)

    def _converse(self, person: int, rng: random.Random, number: int) -> None:
        if person not in self._mine:
            self._mine[person] = self.clients.make()
        parked = self._parked.setdefault(person, [])
        if len(parked) >= MAX_PARKED:  # a person keeps a couple of conversations open, then goes back to one
            self.driver.stopping.wait(max(0.0, min(p.due for p in parked) - time.time()))
        due = sorted((p for p in parked if p.due <= time.time()), key=lambda p: p.due)
        if due:  # come back to a conversation left to react late
            parked.remove(due[0])
            self._talk(person, rng, self._mine[person], due[0])
        else:
            self.conversation(person, rng, self._mine[person], number)
        bound = self.driver.max_conversations
        if bound is not None and number + 1 >= bound:  # the person's last turn at the driver: no new conversation
            self._finish_parked(person, rng)

    def _finish_parked(self, person: int, rng: random.Random) -> None:
        """A person who has started all their conversations comes back to each one left open, when it is due."""
        parked = self._parked.get(person, [])
        while parked and not self.driver.stopping.is_set():
            first = min(parked, key=lambda p: p.due)
            if self.driver.stopping.wait(max(0.0, first.due - time.time())):
                return
            parked.remove(first)
            self._talk(person, rng, self._mine[person], first)

    def conversation(self, person: int, rng: random.Random, clients: tuple[Any, Any], number: int) -> None:
        sdk = "anthropic" if rng.random() < self.anthropic_share else "openai"
        questions: list[str | None] = [t.prompt for t in rng.sample(self.tasks, 3)] + [None]
        if self.kind.openings and rng.random() < 0.5:  # people say hello first (drawn only for kinds that do)
            questions[0] = rng.choice(self.kind.openings)
        first = [{"role": "user", "content": questions[0] or ""}]
        self._talk(person, rng, clients, Parked(0.0, number, sdk, 0, first, questions))

    def _talk(self, person: int, rng: random.Random, clients: tuple[Any, Any], at: Parked) -> None:
        """Go on with a conversation from `at`: a new one (index 0), or one the person comes back to late."""
        cid, messages, late = f"p{person}-c{at.number}", at.messages, at.due > 0
        for i in range(at.index, 4):
            if self.driver.stopping.is_set():
                return
            nxt: str | None
            if late:  # the late message reacts to the reply at `at.index`, already received
                late, reply, messages = False, messages[-1]["content"], messages[:-1]
                with self._lock:
                    turn = next(t for t in reversed(self.turns) if t.conversation == cid and t.index == i)
                    nxt = self.reaction(rng, turn.complied, at.questions[i + 1], turn.answered)
                    turn.next_message, turn.late_s = nxt, time.time() - turn.replied_at
            else:
                sent = time.time()
                reply = self.clients.ask(clients, at.sdk, messages)
                complied, answered = not self.verifier.check(reply), self._answered(at.questions[i], messages, reply)
                nxt, reaction = (None, None) if i == 3 else self.next_message(rng, complied, at.questions[i + 1],
                                                                             answered)  # fmt: skip
                with self._lock:
                    self.turns.append(Turn(person, cid, i, at.sdk, reply, complied, reaction, nxt, sent, time.time(),
                                           answered=answered))  # fmt: skip
                if reaction in ("praise", "correction") and rng.random() < self.habits.late_share:
                    messages = [*messages, {"role": "assistant", "content": reply}]
                    due = time.time() + rng.uniform(*self.habits.late_s)
                    left = Parked(due, at.number, at.sdk, i, messages, at.questions)
                    self._parked.setdefault(person, []).append(left)
                    return  # the person goes off to other conversations and reacts when `due`
            if nxt is None:
                return
            messages = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": nxt}]
            self._think(person, rng, self.think_s)

    def _answered(self, question: str | None, messages: list[dict[str, str]], reply: str) -> bool:
        """Whether the reply answers the person's question: checked (`substance`) when the message it replies to
        asked one of the people's questions; a greeting, a follow-up or a correction of their own is not checked."""
        if self.substance is None or not question or question not in messages[-1]["content"]:
            return True
        return self.substance.answers(question, reply)

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
        reacted = [t for t in turns if t.reaction in ("praise", "correction")]
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
            "late": sum(t.late_s > 0 for t in reacted),
            "off_topic": sum(not t.answered for t in turns),
            "off_topic_corrected": sum(not t.answered for t in reacted),
            "no_verdict": sum(t.reaction in ("followup", "own_correction") for t in turns),
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
