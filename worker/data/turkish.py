"""Turkish word order: who gave what to whom, from case suffixes or from position.

Turkish marks grammatical roles with case suffixes, so the subject (nominative,
bare), the recipient (dative -(y)a/e) and the object (accusative -(y)ı/i/u/ü)
may come in any of the six orders before the verb:

    adam kadına kitabı verdi.     the man gave the book to the woman
    kitabı kadına adam verdi.     (same roles, scrambled)

The task contrasts two variants of the same sentences:

- ``marked``: case suffixes, the three noun phrases scrambled. Roles can only be
  read off the suffixes; position says nothing.
- ``bare``: no suffixes, always subject - recipient - object - verb
  (``adam kadın kitap verdi.``). This is not grammatical Turkish; it is a
  controlled contrast, as in word-order probing studies (Sinha et al. 2021),
  in which roles can only be read off position.

Agents and recipients are people and animals drawn from the same list, so
telling them apart needs the suffix (marked) or the position (bare); the object
is always a thing.

Layout of one example (exactly ``length + 1`` bytes, UTF-8):

    <spaces> distractor. distractor. * target. distractor. kim kime neyi? adam kadın kitap

Distractors are sentences of the same variant from the same lexicon; the target
is the one sentence marked ``* ``, placed at some depth like a pass key. The
question "kim kime neyi?" (who, to whom, what) is answered with the three role
words in that fixed order, in their bare dictionary forms, and only those
answer bytes are trained on and scored. A marker plus a fixed-order answer keeps
the task learnable by a small byte model: finding the target is a pass-key
lookup, and what is left is exactly the contrast under study -- reading roles
from suffixes or from word order -- plus a small lexicon to strip suffixes with.
Both variants of one role tuple have the same answer.

Suffixes are built in code with vowel harmony, a buffer ``y`` after vowels and
consonant softening (kitap -> kitabı), which Turkish applies irregularly and so
is marked per word (Göksel & Kerslake 2005, Turkish: A Comprehensive Grammar).
"""

from __future__ import annotations

import itertools
import zlib
from typing import NamedTuple

import torch

from core.catalog.tasks import TaskConfigError
from worker.data.synthetic import PASSKEY_DEPTHS, Example, ExampleMaker, SyntheticTask

VARIANTS = ("marked", "bare")
QUESTION = "kim kime neyi? "
MARKER = "* "

# -- morphology ---------------------------------------------------------------------------

BACK = set("aıou")
ROUNDED = set("oöuü")
VOWELS = set("aeıioöuü")
VOICELESS = set("çfhkpsşt")
SOFTENED = {"p": "b", "ç": "c", "t": "d", "k": "ğ"}


def _last_vowel(word: str) -> str:
    return next(c for c in reversed(word) if c in VOWELS)


def _i4(word: str) -> str:
    """The four-way high vowel ı/i/u/ü that follows the word's last vowel."""
    v = _last_vowel(word)
    return {(True, False): "ı", (False, False): "i", (True, True): "u", (False, True): "ü"}[
        (v in BACK, v in ROUNDED)
    ]


def _a2(word: str) -> str:
    """The two-way low vowel a/e that follows the word's last vowel."""
    return "a" if _last_vowel(word) in BACK else "e"


def _vowel_suffix(word: str, softens: bool, vowel: str) -> str:
    # A vowel-initial suffix takes a buffer y after a vowel, and softens a final
    # p/ç/t/k to b/c/d/ğ in the words where Turkish does so (kitap, not top).
    if word[-1] in VOWELS:
        return word + "y" + vowel
    if softens:
        word = word[:-1] + SOFTENED[word[-1]]
    return word + vowel


def accusative(word: str, softens: bool = False) -> str:
    return _vowel_suffix(word, softens, _i4(word))


def dative(word: str, softens: bool = False) -> str:
    return _vowel_suffix(word, softens, _a2(word))


def past(stem: str) -> str:
    """Past tense, third person singular: -DI, with d -> t after a voiceless consonant."""
    return stem + ("t" if stem[-1] in VOICELESS else "d") + _i4(stem)


# -- lexicon ------------------------------------------------------------------------------


class Noun(NamedTuple):
    word: str
    softens: bool = False


# People and animals: agents and recipients.
ANIMATE = (
    Noun("adam"),
    Noun("kadın"),
    Noun("çocuk", softens=True),
    Noun("öğretmen"),
    Noun("doktor"),
    Noun("kedi"),
    Noun("köpek", softens=True),
    Noun("kız"),
    Noun("oğlan"),
    Noun("asker"),
    Noun("öğrenci"),
    Noun("kasap", softens=True),
    Noun("kuzu"),
    Noun("müdür"),
    Noun("polis"),
    Noun("hemşire"),
)
# Things: what is given, shown, sent...
THINGS = (
    Noun("kitap", softens=True),
    Noun("mektup", softens=True),
    Noun("top"),
    Noun("elma"),
    Noun("çiçek", softens=True),
    Noun("ekmek", softens=True),
    Noun("anahtar"),
    Noun("defter"),
    Noun("kalem"),
    Noun("para"),
    Noun("bardak", softens=True),
    Noun("kutu"),
)
# Ditransitive verbs (someone VERBs something to someone), as stems.
VERBS = ("ver", "göster", "gönder", "sat", "getir", "götür", "at", "uzat")

# Orders of (agent, recipient, theme) before the verb; 0 is the canonical S IO DO.
ORDERS = tuple(itertools.permutations(range(3)))


class Roles(NamedTuple):
    """Indices into ANIMATE (agent, recipient), THINGS (theme) and VERBS."""

    agent: int
    recipient: int
    theme: int
    verb: int

    def answer(self) -> str:
        return (
            f"{ANIMATE[self.agent].word} {ANIMATE[self.recipient].word} {THINGS[self.theme].word}"
        )


def sentence(roles: Roles, variant: str, order: int = 0) -> str:
    """One sentence with a final full stop; ``order`` (0-5) scrambles the marked variant only."""
    agent, recipient, theme = ANIMATE[roles.agent], ANIMATE[roles.recipient], THINGS[roles.theme]
    if variant == "bare":
        phrases = [agent.word, recipient.word, theme.word]
    else:
        case = [agent.word, dative(*recipient), accusative(*theme)]
        phrases = [case[i] for i in ORDERS[order]]
    return " ".join(phrases) + " " + past(VERBS[roles.verb]) + "."


def both_variants(roles: Roles, order: int = 0) -> dict[str, str]:
    """The same roles said both ways (the test checks that they parse back alike)."""
    return {variant: sentence(roles, variant, order) for variant in VARIANTS}


def _size(text: str) -> int:
    return len(text.encode())


def min_length() -> int:
    """The shortest sequence that holds the longest target sentence, question and answer."""
    pairs = max(
        _size(MARKER + f"{a.word} {dative(*r)} ") + _size(f"{a.word} {r.word} ")
        for a, r in itertools.permutations(ANIMATE, 2)
    )
    things = max(_size(accusative(*t) + " ") + _size(t.word) for t in THINGS)
    verbs = max(_size(past(v) + ". ") for v in VERBS)
    # The marked sentence is never shorter than the bare one; a sequence is length + 1 bytes.
    return pairs + things + verbs + _size(QUESTION) - 1


# The shortest distractor (bare) bounds how many sentences a sequence can hold.
_SHORTEST = (
    min(_size(n.word + " ") for n in ANIMATE) * 2
    + min(_size(t.word + " ") for t in THINGS)
    + min(_size(past(v) + ". ") for v in VERBS)
)


def _draw(row: list[float]) -> tuple[Roles, int]:
    """Roles and a word order from five uniform numbers; the agent is not the recipient."""
    agent = int(row[0] * len(ANIMATE))
    recipient = int(row[1] * (len(ANIMATE) - 1))
    recipient += recipient >= agent
    theme = int(row[2] * len(THINGS))
    verb = int(row[3] * len(VERBS))
    return Roles(agent, recipient, theme, verb), int(row[4] * len(ORDERS))


class TurkishWordOrder(SyntheticTask):
    """Who gave what to whom, in a Turkish sentence marked ``* `` among distractors."""

    name = "sov_tr"

    def __init__(self, variant: str = "both") -> None:
        if variant not in (*VARIANTS, "both"):
            raise TaskConfigError(
                f"task 'sov_tr': parameter 'variant' must be one of 'marked', 'bare', 'both', "
                f"got {variant!r}"
            )
        self.variants = VARIANTS if variant == "both" else (variant,)
        self.min_length = min_length()

    def groups(self) -> tuple[tuple[str, float], ...]:
        return tuple((v, d) for v in self.variants for d in PASSKEY_DEPTHS)

    def example(
        self, length: int, generator: torch.Generator, group: tuple[str, float] | None
    ) -> tuple[bytes, int, str]:
        if length < self.min_length:
            raise ValueError(
                f"sov_tr needs sequences of at least {self.min_length} bytes, got {length}"
            )
        if group is None:  # training: the variant and the depth are drawn too
            pick, depth = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
            variant = self.variants[int(pick * len(self.variants))]
        else:
            variant, depth = group
        # One draw for every sentence that could fit, whatever the variant, so that
        # the same generator state gives the same roles in both variants.
        rows = torch.rand(
            (length + 1) // _SHORTEST + 1, 5, generator=generator, dtype=torch.float64
        ).tolist()
        target, order = _draw(rows[0])
        needle = MARKER + sentence(target, variant, order) + " "
        answer = target.answer()
        budget = length + 1 - _size(needle) - _size(QUESTION) - _size(answer)
        # Whole distractor sentences while they fit; what is left becomes leading spaces
        # (never cutting a two-byte letter in half).
        distractors: list[str] = []
        for row in rows[1:]:
            roles, scramble = _draw(row)
            text = sentence(roles, variant, scramble) + " "
            if _size(text) > budget:
                break
            distractors.append(text)
            budget -= _size(text)
        at = round(depth * len(distractors))
        text = (
            " " * budget
            + "".join(distractors[:at])
            + needle
            + "".join(distractors[at:])
            + QUESTION
            + answer
        )
        label = f"variant={variant} depth={depth:g}" if group is not None else ""
        return text.encode(), _size(answer), label

    def eval_examples(
        self, length: int, per_group: int, make: ExampleMaker | None = None
    ) -> list[Example]:
        # Each example has its own generator, seeded by the task, length, depth and
        # index but not the variant: example i is the same scene said both ways, so
        # the variants are compared on the same roles (and "bare" alone scores the
        # same examples as the bare half of "both").
        make = make or self.example
        return [
            make(length, _example_generator(self.name, length, depth, i), (variant, depth))
            for variant, depth in self.groups()
            for i in range(per_group)
        ]


def _example_generator(task: str, length: int, depth: float, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{task}:{length}:{depth:g}:{index}".encode()))
