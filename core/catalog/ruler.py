"""The texts and sizes of the RULER-style tasks (Hsieh et al. 2024, arXiv:2404.06654),
free of torch: the implementations (``worker.data.ruler``, ``worker.data.aggregation``)
write their examples from these templates, and the catalogue's ``fits`` hooks count
bytes with them, so the two never disagree."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The symbols a niah key or value is made of, and how many characters each has: made-up
# six-letter words (consonant, vowel, ...), seven-digit numbers, 32 hex digits.
SYMBOL_SIZES = {"words": 6, "numbers": 7, "uuids": 32}
# repeat: the pass key's filler sentences; needles: needles of other keys; text: a window
# of a local corpus (the lm task's; ``corpus``), cut into lines.
HAYSTACKS = ("repeat", "needles", "text")
DEFAULT_CORPUS = "pystdlib"

NIAH_NEEDLE = "{key} is {value}. "
NIAH_QUESTION = "What is {keys}? "
# Between the answers of a task with several (in their canonical order).
SEPARATOR = ", "

TRACKING_NAME = 5  # letters of a variable's name
TRACKING_VALUE = 5  # digits of a chain's value
TRACKING_VALUE_LINE = "VAR {name} = {value}. "
TRACKING_COPY_LINE = "VAR {name} = VAR {source}. "
TRACKING_QUESTION = "Which variables hold {value}? "

WORD = SYMBOL_SIZES["words"] + 1  # a word of the list and the space after it
COMMON_QUESTION = "Which {count} words are the most common? "
FREQUENT_QUESTION = "Which {count} words are the most frequent? "


def answer_bytes(count: int, size: int) -> int:
    """Bytes of ``count`` answers of ``size`` characters each, separated."""
    return count * size + (count - 1) * len(SEPARATOR)


def niah_bytes(params: Mapping[str, Any]) -> int:
    """Bytes of a niah example without its haystack: its needles, question and answer."""
    key, value = SYMBOL_SIZES[params["keys"]], SYMBOL_SIZES[params["values"]]
    needle = len(NIAH_NEEDLE.format(key="k" * key, value="v" * value))
    queries = params["num_queries"]
    question = len(NIAH_QUESTION.format(keys=("k" * key + SEPARATOR) * (queries - 1) + "k" * key))
    answer = answer_bytes(queries * params["num_values"], value)
    return params["num_keys"] * params["num_values"] * needle + question + answer


def tracking_bytes(params: Mapping[str, Any]) -> int:
    """Bytes of a variable_tracking example without its filler."""
    hops = params["num_hops"]
    name, value = "N" * TRACKING_NAME, "1" * TRACKING_VALUE
    chain = len(TRACKING_VALUE_LINE.format(name=name, value=value)) + hops * len(
        TRACKING_COPY_LINE.format(name=name, source=name)
    )
    question = len(TRACKING_QUESTION.format(value=value))
    return params["num_chains"] * chain + question + answer_bytes(hops + 1, TRACKING_NAME)


def common_bytes(params: Mapping[str, Any]) -> int:
    """Bytes of the shortest common_words example: the common words alone."""
    count = params["num_common"]
    words = count * params["freq_common"] * WORD
    question = len(COMMON_QUESTION.format(count=count))
    return words + question + answer_bytes(count, SYMBOL_SIZES["words"])


def frequent_words(length: int, params: Mapping[str, Any]) -> int:
    """How many words the list of a frequent_words example of ``length`` bytes holds."""
    count = params["num_top"]
    question = len(FREQUENT_QUESTION.format(count=count))
    return (length + 1 - question - answer_bytes(count, SYMBOL_SIZES["words"])) // WORD


def zipf_counts(words: int, alpha: float) -> list[int]:
    """How often each word of a list of ``words`` occurs, most frequent first: word r
    ``floor(c / r**alpha)`` times for the largest c whose counts fit, and the words left
    over once each."""

    def counts(top: int) -> list[int]:
        out = []
        for rank in range(1, words + 1):
            count = int(top / rank**alpha)
            if count < 1:
                break
            out.append(count)
        return out

    low, high = 1, max(1, words)
    while low < high:  # the largest top whose counts sum to at most ``words``
        middle = (low + high + 1) // 2
        if sum(counts(middle)) <= words:
            low = middle
        else:
            high = middle - 1
    found = counts(low) if words > 0 else []
    return found + [1] * (words - sum(found))


def _too_short(name: str, needed: int, longest: int) -> list[str]:
    if needed > longest + 1:
        return [
            f"task {name!r} with these parameters needs sequences of at least "
            f"{needed - 1} bytes; {longest} is too short"
        ]
    return []


def niah_problem(params: Mapping[str, Any]) -> str | None:
    """What is wrong with a niah task's parameters together (the corpus name's form is
    checked as the lm task's)."""
    if params["num_queries"] > params["num_keys"]:
        return f"num_queries = {params['num_queries']} exceeds num_keys = {params['num_keys']}"
    if params["haystack"] != "text" and params["corpus"] != DEFAULT_CORPUS:
        return (
            f"corpus {params['corpus']!r} is read only by haystack 'text', "
            f"not by haystack {params['haystack']!r}"
        )
    return None


def niah_fits(params: Mapping[str, Any], longest: int) -> list[str]:
    return _too_short("niah", niah_bytes(params), longest)


def tracking_fits(params: Mapping[str, Any], longest: int) -> list[str]:
    return _too_short("variable_tracking", tracking_bytes(params), longest)


def common_fits(params: Mapping[str, Any], longest: int) -> list[str]:
    return _too_short("common_words", common_bytes(params), longest)


def frequent_fits(params: Mapping[str, Any], longest: int) -> list[str]:
    """The top words must be more frequent than the rest, and each than the next."""
    top = params["num_top"]
    counts = zipf_counts(frequent_words(longest, params), params["alpha"])
    if len(counts) <= top or any(counts[i] <= counts[i + 1] for i in range(top)):
        return [
            f"task 'frequent_words' at length {longest} has no {top} words each more "
            f"frequent than the next (alpha={params['alpha']:g}); raise the length or alpha"
        ]
    return []
