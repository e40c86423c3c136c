"""What a sentence of a reaction DOES, in words of no preference kind: objects to the reply, sets a new task, or
updates the person's own request.

The reaction classifier (`reactions.py`) reads how a message feels; these rules read its grammar, so that a
correction of a kind nobody wrote prototypes for still reads as one:

- an **objection** to the reply: a question that challenges it ("Source?", "Why did you assume ...?", "What are the
  risks though?", "Did you forget ...?"), a request or a stated need that refers back to it ("Can you make it ...",
  "I need this ...", "Please stick to ..."), a rule for the future ("next time", "from now on", "always"), a
  complaint that negates it or names an error ("You didn't ...", "That's not ...", "You assumed ...");
- a **follow-up task**: new work that opens with "now", "next", "also", "another", "do the same" or ends with
  "as well"/"too" (after praise it is an approval, never a correction), unless it edits the same reply
  ("now make it shorter");
- an **update** of the person's own request ("Oh sorry, I meant six people", "I forgot to say ...").

The vocabulary is grammar (pronouns, auxiliaries, wh-words, markers of time, negation and politeness), never the
words of a preference: nothing here names a length, a format, a tone or a language.
"""

from __future__ import annotations

import re

# The reply or something in it, referred back to: a pronoun, "the ...", "your ...", a comparative.
REFERS = re.compile(
    r"(?i)\b(?:it|this|that|these|those|them|you|your|yours|the|each|every|any\s+of|all\s+of|less|more|fewer|"
    r"cheaper|shorter|longer|simpler|clearer|easier|better|smaller|bigger|lower|higher|without|instead|"
    r"du|dein\w*|tu|ton|ta|tes|vous|votre|usted|tú|tu)\b"
)
FUTURE = re.compile(
    r"(?i)\b(?:next\s+time|from\s+now\s+on|in\s+(?:the\s+)?future|going\s+forward|always|never\s+again|"
    r"remember|as\s+i\s+(?:said|asked|told\s+you)|i\s+(?:said|told\s+you|asked(?:\s+for)?)\b|"
    r"nächstes\s+mal|in\s+zukunft|immer|la\s+prochaine\s+fois|à\s+l'avenir|toujours|la\s+próxima\s+vez|siempre|"
    r"de\s+ahora\s+en\s+adelante)"
)
# A question that challenges the reply rather than asking something new.
CHALLENGE = re.compile(
    r"(?i)\b(?:says\s+who|who\s+said|how\s+do\s+you\s+know|where\s+did\s+you\s+get|did\s+you\s+(?:forget|miss|"
    r"skip|read|even)|didn'?t\s+you|shouldn'?t\s+(?:you|there|it|this|that)|isn'?t\s+(?:it|this|that|there)|"
    r"where(?:'s|\s+is|\s+are)\s+(?:the|my|your|any)|what\s+happened\s+to|"
    r"why\s+(?:(?:did|do|would|have)\s+you|(?:is|are|was)\s+(?:this|it|that|there|everything|all|your|the\s+"
    r"(?:answer|reply))|so|not|no|such)\b|"
    r"warum|pourquoi|por\s*qué|perché|waarom)|^\W*why(?:\s+[\w'’]+){1,2}\s*[?？]"
    r"|\b(?:though|then|really|seriously|at\s+all)\s*[?？]"
)
QUESTION_WORD = re.compile(
    r"(?i)^\W*(?:what|why|how|when|where|which|who|whose|is|are|was|were|do|does|did|can|could|should|would|will|"
    r"shall|may|might|have|has|had|am|wie|was|wo|wann|welche\w*|que|quel\w*|qu'|comment|où|quand|qué|cómo|cuál|"
    r"dónde|cuándo|cuánto)\b"
)
POLITE = re.compile(
    r"(?i)\b(?:please|pls|plz|kindly|(?:can|could|would|will)\s+you|would\s+you\s+mind|bitte|"
    r"s'il\s+(?:te|vous)\s+pla[iî]t|por\s+favor|per\s+favore)\b"
)
NEED = re.compile(
    r"(?i)\bi\s+(?:really\s+|just\s+|only\s+|still\s+)?(?:need|needed|want|wanted|have\s+to|must)\b|"
    r"\bi(?:'d|\s+would)\s+(?:rather|prefer|like)\b|\bi\s+prefer\b|\bi\s+(?:can'?t|cannot|don'?t|won'?t)\s+"
    r"(?:use|read|afford|follow|understand|send|take|see|find|do|work|use)\b|\bwon'?t\s+accept\b"
)
NEGATION = re.compile(
    r"(?i)\b(?:not|no|nothing|none|never|nowhere|without|zero|nicht|kein\w*|pas|nada|ningún)\b|n['’]t\b|"
    r"\b(?:didnt|dont|doesnt|cant|wont|isnt|wasnt|arent)\b"
)
# The speaker names the reply's mistake: "You assumed ...", "You left out ...", "You're guessing ...".
ERROR = re.compile(
    r"(?i)\byou(?:'ve|\s+have|'re|\s+are)?\s+(?:forgot|forgotten|left|missed|skipped|ignored|assumed|assuming|"
    r"guessed|guessing|mixed|confused|misread|misunderstood|overlooked|keep|still|made\s+(?:that|this|it)\s+up|"
    r"rambling|repeating)\b|\b(?:wrong|incorrect|inaccurate|false|made\s+up|"
    r"too\s+much|too\s+\w+|way\s+(?:too|over)|over\s+(?:my|the|our)|a\s+pain|useless|pointless|unreadable|"
    r"(?:hard|difficult|impossible)\s+to\s+(?:read|follow|understand|scan|use|find)|"
    r"confusing|falsch|faux|incorrecto)\b"
)
# New work: a task that opens with "now"/"next"/"also"/"another", or "... as well"/"too"/"the same for".
TASK = re.compile(
    r"(?i)^\W*(?:(?:ok|okay|cool|so|and|great|right)\W+)*(?:now(?!\s+on\b)|next\b(?!\s+time)|also|another|"
    r"one\s+more|then|new\s+(?:task|question|topic)|different\s+(?:topic|question)|unrelated)\b|\b(?:as\s+well|too)\s*[.?!]*$|\bdo\s+the\s+same\b|\bnow\s+(?:do|write|give|make|"
    r"summari[sz]e|translate|draft|add|list|turn|plan)\b|\b(?:you|we)\s+(?:now\s+)?also\b|\b(?:write|send|draft)\b[^.?!]*\bnow\s*[.?!]*$"
)
# An edit of the same reply, even after "now": "now make it shorter", "now keep it simpler".
EDIT = re.compile(
    r"(?i)\b(?:make|keep|get)\s+(?:it|this|that|them)\s+(?:\w+\s+)?(?:more|less|\w+er)\b|"
    r"\b(?:say|put|write|give)\s+(?:it|this|that|them)\b|\b(?:try|redo|rewrite|rephrase)\b"
)
# The person updates their own request: "Oh sorry, I meant ...", "I forgot to say ...", "Update: ...".
UPDATE = re.compile(
    r"(?i)^\W*(?:(?:oh|ah|oops|wait|sorry|actually|hold\s+on|just\s+reali[sz]ed|also|and)\W+)*"
    r"(?:(?:i\s+)?(?:forgot\s+to\s+(?:say|mention|add|tell)|should\s+(?:mention|add|say)|meant\b|"
    r"changed\s+my\s+mind|gave\s+you\s+the\s+wrong|made\s+a\s+typo)|"
    r"(?:my\s+(?:bad|mistake|typo)|typo\s+on\s+my|let\s+me\s+add|one\s+more\s+thing|update\s*:|never\s*mind|"
    r"forgot\s+to\s+mention|i\s+(?:just\s+)?realised|i\s+just\s+realized))|\b(?:on\s+my\s+(?:side|end)|"
    r"my\s+(?:plans|boss|client)\s+(?:just\s+)?changed)\b"
)
# Grammar words a command never starts with (a sentence that starts with one is no command).
NOT_COMMAND = re.compile(
    r"(?i)^\W*(?:i|i'm|i've|i'd|i'll|me|my|we|our|you|your|he|she|they|it|it's|its|this|that|these|those|there|"
    r"here|the|a|an|some|any|what|why|how|when|where|which|who|is|are|was|were|do|does|did|can|could|should|would|"
    r"will|ok|okay|yes|no|hi|hello|hey|thanks|thank|cheers|lol|ha|haha|hmm+|oh|ooh|ah|aw|wow|good|great|nice|happy|"
    r"interesting|different|long|let|let's|anyway|btw|see|k|if|when|because|since|although|as|after|before|while|"
    r"just|got|and|so|or|huh|eh|whats|hows|wheres|whos|new|next|another|also)\b"
)


# What a command refers back to: a pronoun or "your" (the "the ..." of "give me the answer" may be new content).
COMMAND_REFERS = re.compile(
    r"(?i)\b(?:it|this|these|those|them|your|each|every|any\s+of|all\s+of|without|instead|"
    r"less|more|fewer|cheaper|shorter|longer|simpler|clearer|easier|better)\b"
)
ACHIEVED = re.compile(  # the reply is what was wanted: "exactly what I needed", "That's the style I want."
    r"(?i)\b(?:all|what|exactly|everything|just\s+what)\s+i\s+(?:need|needed|want|wanted)\b|"
    r"^\W*(?:that|this|it)(?:'s|’s|\s+is|\s+was)\s+(?:[\w'’]+\s+){0,3}i\s+(?:need|needed|want|wanted|like)\b"
)
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]")


def is_question(sentence: str) -> bool:
    return sentence.rstrip().endswith(("?", "？"))


def refers_back(sentence: str) -> bool:
    """Whether a sentence refers back to the reply (the "you" of "could you" does not count)."""
    return REFERS.search(POLITE.sub(" ", sentence)) is not None


def follow_up(sentence: str) -> bool:
    """Whether a sentence sets new work ("Now translate it", "Also draft ...", "... as well?") rather than
    editing the same reply ("now make it shorter") or setting a rule for later ones."""
    return bool(TASK.search(sentence)) and not EDIT.search(sentence) and not FUTURE.search(sentence)


def update(sentence: str) -> bool:
    """Whether the person updates their own request ("Oh sorry, I meant ...", "Forgot to mention ...")."""
    return bool(UPDATE.search(sentence))


def command(sentence: str) -> bool:
    """A sentence that starts as a command: its first word is none of the grammar words a statement or a question
    starts with, and the second is no copula ("Money is tight" states)."""
    words = re.findall(r"[\w'’]+", sentence)
    if len(words) < 2 or NOT_COMMAND.match(sentence) or words[0].casefold().endswith("ing"):
        return False
    return words[1].casefold() not in {"is", "are", "was", "were", "'s", "has", "have"}


def objection(sentence: str, new_content: bool = False) -> str | None:
    """How a sentence objects to the reply: `strong` (a challenging question, a short bare question such as
    "Source?" or "Any downsides?", a rule for later replies, a complaint that negates the reply or names its
    mistake), `weak` (a request, a command or a stated need that refers back to the reply: praise such as
    "Appreciate it!" has the same grammar, so the classifier's approval overrides it) or None.
    `new_content`: the sentence asks for new content ("write a poem", "what about Madrid?"), which no request
    rule reads as an objection."""
    if update(sentence) or follow_up(sentence) or sentence.rstrip().endswith((":", "：")):
        return None
    if is_question(sentence):
        words = re.findall(r"[\w'’]+", sentence)
        bare = 0 < len(words) <= 3 and not (QUESTION_WORD.match(sentence) or NOT_COMMAND.match(sentence))
        if CHALLENGE.search(sentence) or FUTURE.search(sentence) or (bare and not CJK.search(sentence)):
            return "strong"
        polite = POLITE.search(sentence) and COMMAND_REFERS.search(POLITE.sub(" ", sentence))
        return "weak" if polite and not new_content else None
    if FUTURE.search(sentence) or ERROR.search(sentence) or (NEGATION.search(sentence) and refers_back(sentence)):
        return "strong"
    if new_content:
        return None
    need = NEED.search(sentence) is not None and not ACHIEVED.search(sentence)
    asks = POLITE.search(sentence) is not None or need
    if (asks and refers_back(sentence)) or (command(sentence) and COMMAND_REFERS.search(sentence) is not None):
        return "weak"
    return None
