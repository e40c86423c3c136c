"""What a sentence of a reaction DOES, in words of no preference kind: objects to the reply, sets a new task, or
updates the person's own request.

The reaction classifier (`reactions.py`) reads how a message feels; these rules read its grammar, so that a
correction of a kind nobody wrote prototypes for still reads as one:

- an **objection** to the reply: a question that challenges it ("Source?", "Why did you assume ...?", "What are the
  risks though?", "Did you forget ...?", "Why all the jargon?", "Huh?") or asks about the reply itself (a
  demonstrative pronoun, an anaphoric "other"/"else", its words quoted back, "Any ...?"), a request or a stated
  need that refers back to it ("Can you make it ...", "I need this ...", "Please stick to ..."), a command (a verb
  first, with an object, a preposition or an adverb of order: "Start with the conclusion.", "Talk to me ..."),
  a request with a verb of phase or an adverb of order ("Could you begin with ...?", "... the total first?"), a
  suggestion ("Maybe open with ...?", "... would help.", "Your ... should ...", "you could ..."), a bare change
  of degree ("ok but more direct"), a plea ("Decimals please."), what the speaker cannot use ("I don't know what
  ... is", "I have no background in ..."), displeasure ("meh", "ugh"), a rule for the future ("next time",
  "from now on", "always"), a complaint that negates it or names an error ("You didn't ...", "That's not ...",
  "You assumed ...", "You only listed ...", "... has a typo");
- a **follow-up task**: new work that opens with "now", "next", "also", "another", "do the same" or ends with
  "as well"/"too" (after praise it is an approval, never a correction), unless it edits the same reply
  ("now make it shorter");
- an **update** of the person's own request ("Oh sorry, I meant six people", "I forgot to say ...", "Sorry, the
  meeting is at 3", "I should have mentioned ...", "Scratch that, ...", "Turns out ...").

A question that points at the reply with a pronoun as its subject ("How long will this take?") is about the reply;
with the pronoun as an object ("How do I explain this to my boss?"), only when it asks no new content.

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
    r"(?i)\b(?:next\s+time|from\s+now\s+on|from\s+here\s+on|in\s+(?:the\s+)?future|going\s+forward|always|never\s+again|"
    r"remember|as\s+i\s+(?:said|asked|told\s+you)|i\s+(?:said|told\s+you|asked(?:\s+for)?)\b|"
    r"nächstes\s+mal|in\s+zukunft|immer|la\s+prochaine\s+fois|à\s+l'avenir|toujours|la\s+próxima\s+vez|siempre|"
    r"de\s+ahora\s+en\s+adelante)"
)
# Displeasure said as an interjection: "meh.", "ugh, ...".
DISPLEASURE = re.compile(r"(?i)^\W*(?:meh|ugh+|sigh|hmph|pfft|yikes)\b")
# A question that challenges the reply rather than asking something new.
CHALLENGE = re.compile(
    r"(?i)\b(?:says\s+who|who\s+said|how\s+do\s+you\s+know|where\s+did\s+you\s+get|did\s+you\s+(?:forget|miss|"
    r"skip|read|even)|didn'?t\s+you|shouldn'?t\s+(?:you|there|it|this|that)|isn'?t\s+(?:it|this|that|there)|"
    r"where(?:'s|\s+is|\s+are)\s+(?:the|my|your|any)|what\s+happened\s+to|"
    r"why\s+(?:(?:did|do|would|have|are|were)\s+you|(?:is|are|was)\s+(?:this|it|that|there|everything|all|your|the\s+"
    r"(?:answer|reply))|so|not|no|such)\b|"
    r"warum|pourquoi|por\s*qué|perché|waarom)|^\W*why(?:\s+[\w'’]+){1,2}\s*[?？]"
    # a why-question without a verb asks what something is doing in the reply: "Why all the jargon?"
    r"|^\W*why\s+(?!(?:is|are|was|were|do|does|did|can|could|should|would|will|has|have|had|must|might)\b)"
    r"(?:[^\s?？]+\s+){0,3}[^\s?？]+\s*[?？]"
    # a yes/no question that doubts: "Is that really the only way?"
    r"|^\W*(?:is|are|was|were|do|does|did|can|could|should|would|will|has|have)\b[^?？]*\breally\b"
    r"|\b(?:though|then|really|seriously|at\s+all)\s*[?？]"
    r"|^\W*(?:huh|eh|what|sorry|pardon|come\s+again)\W*[?？]\W*$"  # confusion: "Huh?"
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
# The speaker cannot use what the reply takes for granted: "I don't know what an API is", "I have no background
# in ...", "You lost me". Said right after a reply, it says the reply missed them.
CANNOT = re.compile(
    r"(?i)\bi\s+(?:don'?t|do\s+not|didn'?t)\s+(?:know|get|see)\s+(?:what|how|why|which|who|where|it|this|that)\b|"
    r"\bi\s+(?:have|had|got)\s+no\s+(?:idea|clue|background|experience)\b|\blost\s+me\b|"
    r"\bi\s+(?:don'?t|can'?t|cannot|do\s+not)\s+(?:follow|understand)\b"
)
NEGATION = re.compile(
    r"(?i)\b(?:not|no|nothing|none|never|nowhere|nobody|no\s+one|without|zero|nicht|kein\w*|pas|nada|ningún)\b|n['’]t\b|"
    r"\b(?:didnt|dont|doesnt|cant|wont|isnt|wasnt|arent)\b"
)
# The speaker names the reply's mistake: "You assumed ...", "You left out ...", "You're guessing ...".
ERROR = re.compile(
    r"(?i)\byou(?:'ve|\s+have|'re|\s+are)?\s+(?:forgot|forgotten|left|missed|skipped|ignored|assumed|assuming|"
    r"guessed|guessing|mixed|confused|misread|misunderstood|overlooked|keep|still|made\s+(?:that|this|it)\s+up|"
    r"rambling|repeating|(?:only|just)\s+(?:gave|give|said|say|listed|list|used|use|mentioned|wrote|told))\b|\b(?:wrong|incorrect|inaccurate|false|made\s+up|(?:has|have|there's|there\s+is|"
    r"there\s+are|with)\s+(?:a|an|\w+)\s+(?:\w+\s+)?(?:error|errors|bug|bugs|typo|typos|mistake|mistakes)|"
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
# The speaker owns a slip or an omission in what THEY said: "I should have mentioned ...", "I got the date wrong",
# "I wasn't clear", "my fault".
SELF_SLIP = re.compile(
    r"(?i)\bi\s+(?:should\s+have|should['’]ve|shoulda)\s+(?:said|mentioned|specified|added|told|given|explained|"
    r"included|asked|written|clarified)\b|"
    r"\bi\s+(?:got|had|typed|wrote|put|gave\s+you)\s+(?:the|that|it|my|a)\s+(?:\w+\s+){0,2}wrong\b|"
    r"\bi\s+(?:left\s+out|misspoke|mistyped|mixed\s+up|wasn['’]?t\s+clear|was\s+unclear|asked\s+(?:that|it)\s+badly|"
    r"(?:phrased|worded)\s+(?:that|it)\s+badly|just\s+remembered|(?:just\s+)?found\s+out|need\s+to\s+amend)\b|"
    r"\bmy\s+(?:fault|error|apologies)\b|\bfrom\s+my\s+(?:side|end)\b"  # "on my side": UPDATE
)
# A discourse marker of self-repair or of news about the speaker's situation ("Scratch that", "To clarify",
# "Turns out ...", "For context", "by the way"); an update only when the sentence does not address the reply ("By
# the way, your total is wrong" objects).
SELF_MARK = re.compile(
    r"(?i)(?:^|[.!,;]\s*)(?:scratch\s+that|to\s+clarify|let\s+me\s+(?:clarify|rephrase|restate|reword|put\s+it\s+"
    r"(?:another|differently))|to\s+be\s+(?:more\s+)?(?:precise|specific)|rewording|correction\s*:|edit\s*:|"
    r"p\.?s\.?\s*[:,]|(?:small\s+|slight\s+|quick\s+)?change\s+of\s+plans?|turns\s+out|heads\s+up|"
    r"for\s+(?:some\s+)?context|(?:some\s+)?background|forgot\s+(?:a|one)\s+(?:detail|thing)|"
    r"one\s+(?:detail|thing)\s+i\s+(?:left\s+out|forgot)|by\s+the\s+way|btw|fyi)\b"
)
SECOND_PERSON = re.compile(r"(?i)\b(?:you|your|yours|you['’]\w+)\b")
# News about the speaker after a marker of surprise or correction: "Ah wait, my kid is seven", "Actually, I'm in
# Canada" (not a need: "Actually, I need metric" objects).
OWN_NEWS = re.compile(
    r"(?i)^\W*(?:oh|ah|wait|actually|oops|hmm+|hold\s+on)\W+(?:(?:oh|ah|wait|actually)\W+)?(?:my|our|we['’]re|we\s+are|"
    r"we\s+have|i['’]m|i\s+am|i\s+have|i['’]ve|i\s+live|i\s+work)\b(?!\s+(?:asking|looking)\b)(?![^.?!]*\b(?:need|want|wanted|"
    r"asked|said|told)\b)"
)
# The person updates their own request: "Oh sorry, I meant ...", "I forgot to say ...", "Update: ...".
UPDATE = re.compile(
    r"(?i)^\W*(?:(?:oh|ah|oops|wait|sorry|actually|hold\s+on|just\s+reali[sz]ed|also|and)\W+)*"
    r"(?:(?:i\s+)?(?:forgot\s+to\s+(?:say|mention|add|tell)|should\s+(?:mention|add|say)|meant\b|"
    r"changed\s+my\s+mind|gave\s+you\s+the\s+wrong|made\s+a\s+typo)|"
    r"(?:my\s+(?:bad|mistake|typo)|typo\s+on\s+my|let\s+me\s+add|one\s+more\s+thing|update\s*:|never\s*mind|"
    r"forgot\s+to\s+mention|i\s+(?:just\s+)?realised|i\s+just\s+realized))|\b(?:on\s+my\s+(?:side|end)|"
    r"my\s+(?:plans|boss|client)\s+(?:just\s+)?changed)\b"
    # the speaker apologises for their own slip ("Sorry, the deadline is Monday"), but not "Sorry, I don't follow"
    r"|^\W*(?:oops|whoops|sorry|apologies|my\s+bad)\W+(?!(?:but|though|what|i|i['’]\w+|to|that|this|it|you|your)\b)\w"
)
# Grammar words a command never starts with (a sentence that starts with one is no command).
NOT_COMMAND = re.compile(
    r"(?i)^\W*(?:i|i'm|i've|i'd|i'll|me|my|we|our|you|your|he|she|they|it|it's|its|this|that|these|those|there|"
    r"here|the|a|an|some|any|what|why|how|when|where|which|who|is|are|was|were|do|does|did|can|could|should|would|"
    r"will|ok|okay|yes|no|hi|hello|hey|thanks|thank|cheers|lol|ha|haha|hmm+|oh|ooh|ah|aw|wow|good|great|nice|happy|"
    r"interesting|different|long|let|let's|anyway|btw|see|k|if|when|because|since|although|as|after|before|while|"
    r"just|got|and|so|or|huh|eh|whats|hows|wheres|whos|new|next|another|also|not|help|have|yeah|yep|yup|nope|nah|"
    r"sure|wow|cool|love|loved|like|liked|appreciate|appreciated)\b"
)


# A subject pronoun (or its contraction) second: a statement ("now we're talking"), not a command.
SUBJECT = re.compile(r"(?i)^(?:i|we|they|he|she|i['’]\w+|we['’]\w+|you['’]\w+|they['’]\w+|he['’]s|she['’]s)$")


# What a command refers back to: a pronoun or "your" (the "the ..." of "give me the answer" may be new content).
COMMAND_REFERS = re.compile(
    r"(?i)\b(?:it|this|these|those|them|your|each|every|any\s+of|all\s+of|without|instead|other|else|only|"
    r"that(?=\s+(?:in|into|as|with|without|for|again|up|down|out|more|less|part|bit)\b|\s*[?.!,]*$)|"
    r"less|more|fewer|cheaper|shorter|longer|simpler|clearer|easier|better)\b"
)
ACHIEVED = re.compile(  # the reply is what was wanted: "exactly what I needed", "That's the style I want."
    r"(?i)\b(?:all|what|exactly|everything|just\s+what)\s+i\s+(?:need|needed|want|wanted)\b|"
    r"^\W*(?:that|this|it)(?:'s|’s|\s+is|\s+was)\s+(?:[\w'’]+\s+){0,3}i\s+(?:need|needed|want|wanted|like)\b|"
    r"\b(?:just|exactly)\s+(?:how|the\s+way)\s+i\s+(?:like|liked|want|wanted|need|needed)\b"
)
# A clause boundary where a second command may start: "..., so annotate it", "... and add a docstring".
CLAUSE_START = re.compile(r"(?i)\s*[,;]\s*(?:so\s+|and\s+|then\s+|just\s+)?|\s+(?:so|and\s+then)\s+")
# After a command's first word, what makes it a verb phrase rather than a fragment of praise ("solid answer",
# "Bang on"): an object pronoun, an article, a preposition with its object, an adverb of order.
VERB_PHRASE = re.compile(
    r"(?i)^\W*[\w'’]+\s+(?:\S+\s+)*?\W*(?:(?:me|us|first|then|after|afterwards|again)\b|"
    r"(?:the|a|an|some|to|with|into|in|on|up|out|off|down|by|from|for|at|as|before)\b(?=\W+\w))"
)
# A change said as what would be better or what the reply should do: "A one-line takeaway at the start would help.",
# "Your first sentence should be ...", "you could talk to me".
SUGGEST = re.compile(
    r"(?i)\b(?:would|['’]d)\s+(?:be\s+(?:much\s+|so\s+|a\s+lot\s+)?(?:better|nicer|easier|clearer|more\s+\w+|"
    r"helpful|great|good|ideal)|help|work\s+better)\b|\byour\s+(?:[\w'’-]+\s+){1,4}should\b|"
    r"^\W*(?:\w+\W+){0,1}you\s+(?:could|should|might\s+want\s+to|need\s+to|must|have\s+to)\b"
)
# A request that arranges the reply: a verb of phase (aspectual) or position ("Could you begin with ...?", "Can you
# stop ...?") or an adverb of sequence ("Can you give me the total first?").
ARRANGE = re.compile(
    r"(?i)\b(?:begin|start|stop|quit|keep|continue|finish|end|lead|open|first|then|afterwards|after\s+that|"
    r"at\s+the\s+(?:top|start|end|bottom|beginning))\b"
)
# A bare change of degree, after fillers or "but": "ok but more direct", "a bit less, please".
DEGREE = re.compile(
    r"(?i)^\W*(?:(?:ok|okay|hmm+|well|so|and|but|now|just|yes|no|much|way|a\s+bit|a\s+little|even|far)\W+)*"
    r"(?:more|less|fewer)\s+[\w'’-]+\W*(?:[\w'’-]+\W*){0,3}$"
)
HEDGE = re.compile(r"(?i)^\W*(?:maybe|perhaps|possibly|ideally)\W+")
# A question about the reply itself: a demonstrative pronoun ("How long will this take?", "What would that look
# like?", "Is this a ten-minute job?"), not a demonstrative before a noun ("this weekend").
_POINTS_AT = (  # a question word or auxiliary early in the sentence, then "this"/"that"
    r"(?i)(?:^\W*(?:\w+\W+){0,1}|[,;]\s*)(?:what|how|why|when|where|which|who|is|are|was|will|would|does|do)\b"
    r"[^?？]*?\b(?:this|that)\b"
)
DEMONSTRATIVE = re.compile(
    _POINTS_AT + r"(?=\s+(?:is|was|will|would|does|do|mean|means|look|looks|take|takes|work|works|cost|costs|"
    r"a|an|the)\b)"
)
# The same pronoun as an object ("What's the history behind this?", "How do I explain this to my boss?"): about the
# reply only in a question that asks no new content; "What should I do after that?" is new work on it.
DEMONSTRATIVE_OBJECT = re.compile(_POINTS_AT + r"(?=\s+(?:in|into|for|with|on|to)\b|\s*[?？])")
# A question about the reply itself: a demonstrative pronoun, an anaphoric "other"/"else"/"instead", "each", or
# the reply's words quoted back ("What does 'idempotent' mean?").
ABOUT_REPLY = re.compile(
    DEMONSTRATIVE.pattern + r"|(?i:\b(?:other|else|instead|each)\b)|(?<!\w)['\"“‘][^'\"”’]{2,40}['\"”’](?!\w)"
)
# "Any downsides?", "Any idea of the total time?": a short question whether the reply has more, without a verb.
ANY = re.compile(
    r"(?i)^\W*(?:and\s+|so\s+|hmm+\W+)?any\s+(?!(?:\w+\s+)*?(?:is|are|was|were|do|does|can|will)\b)"
    r"(?:[\w'’-]+\s+){0,4}[\w'’-]+\s*[?？]\s*$"
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
    """Whether the person updates their own request ("Oh sorry, I meant ...", "Forgot to mention ...") or repairs
    what they said themselves: a slip of their own (`SELF_SLIP`: "I should have mentioned ..."), news about their
    situation after "oh"/"wait"/"actually" (`OWN_NEWS`), or a marker of self-repair in a sentence that does not
    address the reply (`SELF_MARK`: "Scratch that, ...", "Turns out ...")."""
    if UPDATE.search(sentence) or SELF_SLIP.search(sentence) or OWN_NEWS.match(sentence):
        return True
    return SELF_MARK.search(sentence) is not None and SECOND_PERSON.search(sentence) is None


def command(sentence: str) -> bool:
    """A sentence that starts as a command: its first word is none of the grammar words a statement or a question
    starts with, and the second is no copula ("Money is tight" states)."""
    words = re.findall(r"[\w'’]+", sentence)
    if len(words) < 2 or NOT_COMMAND.match(sentence) or words[0].casefold().endswith("ing"):
        return False
    return words[1].casefold() not in {"is", "are", "was", "were", "'s", "has", "have"} and not SUBJECT.match(words[1])


def objection(sentence: str, new_content: bool = False) -> str | None:
    """How a sentence objects to the reply: `strong` (a challenging question, a short bare question such as
    "Source?", displeasure, a rule for later replies, a complaint that negates the reply or names its mistake, a
    command about the reply after a statement), `weak` (a request, a command, a suggestion or a stated need about
    the reply, a question about the reply itself: praise such as "Appreciate it!" has the same grammar, so the
    classifier's approval overrides it) or None.
    `new_content`: the sentence asks for new content ("write a poem", "what about Madrid?"), which no request
    rule reads as an objection unless it refers back to the reply."""
    if update(sentence) or follow_up(sentence) or sentence.rstrip().endswith((":", "：")) or ACHIEVED.search(sentence):
        return None
    if DISPLEASURE.match(sentence):
        return "strong"
    if is_question(sentence):
        return _question(sentence, new_content)
    if FUTURE.search(sentence) or ERROR.search(sentence) or (NEGATION.search(sentence) and refers_back(sentence)):
        return "strong"
    if new_content:
        return None
    first, *later = commands(sentence)
    if any(command(c) and COMMAND_REFERS.search(c) for c in later):
        return "strong"  # "I have to present this, so trim it.": a statement, then a command about the reply
    need = NEED.search(sentence) is not None and not ACHIEVED.search(sentence)
    asks = POLITE.search(sentence) is not None or need
    said = (asks and refers_back(sentence)) or CANNOT.search(sentence) or SUGGEST.search(sentence)
    commanded = any(command(c) and (COMMAND_REFERS.search(c) or VERB_PHRASE.search(c)) for c in (first, *later))
    return "weak" if said or plea(sentence) or DEGREE.match(sentence) or commanded else None


def _question(sentence: str, new_content: bool) -> str | None:
    """`objection` of a question: challenging or bare is strong; about the reply itself ("How long would that
    take?", "Any risks?") or a request about it ("Could you begin with ...?", "Maybe open with ...?") is weak."""
    words = re.findall(r"[\w'’]+", sentence)
    bare = 0 < len(words) <= 3 and not (QUESTION_WORD.match(sentence) or NOT_COMMAND.match(sentence))
    if CHALLENGE.search(sentence) or FUTURE.search(sentence) or (bare and not CJK.search(sentence)):
        return "strong"
    if (
        ABOUT_REPLY.search(sentence)
        or ANY.match(sentence)
        or (not new_content and DEMONSTRATIVE_OBJECT.search(sentence))
    ):
        return "weak"  # about the reply itself, or whether it has more: no new content
    if new_content:
        return None
    polite = POLITE.search(sentence) is not None
    refers = COMMAND_REFERS.search(POLITE.sub(" ", sentence)) is not None
    arranges = ARRANGE.search(sentence) is not None
    return "weak" if (polite and (refers or arranges)) or suggestion(sentence) else None


def commands(sentence: str) -> list[str]:
    """The sentence and each of its clauses after a comma or "so"/"and"/"then" ("I'll maintain this, so
    annotate it."): where a command may start."""
    return [sentence, *(c for c in CLAUSE_START.split(sentence)[1:] if c.strip())]


def suggestion(question: str) -> bool:
    """A command softened into a question: "Maybe start with the price?", "Perhaps open with one line?"."""
    m = HEDGE.match(question)
    return m is not None and command(question[m.end() :])


def plea(sentence: str) -> bool:
    """A few words and "please", no verb of a statement: "Metric please", "Reference please", "Auf Deutsch bitte"."""
    words = re.findall(r"[\w'’]+", POLITE.sub(" ", sentence))
    return (
        POLITE.search(sentence) is not None
        and 0 < len(words) <= 3
        and not re.match(r"(?i)^\W*(?:yes|yeah|yep|ok|okay|sure|thanks|thank|no|more|next|another)\b", sentence)
    )
