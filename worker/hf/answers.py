"""The synthetic tasks in an hf: model's tokens.

A synthetic task draws each example as UTF-8 text that ends in its answer
(``worker.data.synthetic``: ``example(length, generator, group)`` gives ``length + 1``
bytes, how many of the last ones are the answer, and the example's group). An hf:
model reads the same examples in its own tokens, drawn by that same code - the task's
definition stays in one place:

- **the text**: the task's example at a *byte budget* B (what its ``length`` argument
  is for a byte-level model), decoded as UTF-8, and tokenized whole with the model's
  tokenizer, no special token added: the model reads the tokens the text has, never a
  prompt and an answer tokenized apart (a tokenizer's prefix space or a merge across
  them would change the input);
- **the length**: B is searched for (deterministically, from the budget the example
  before took, each try drawn from the same generator state) so that the text is
  exactly ``length + 1`` tokens; where no budget near the bracket gives exactly that
  (a count of tokens is not monotone in bytes), the largest that fits below, and the
  tokens missing are the tokenizer's end-of-text token (the separator of the lm task's
  documents) put before the text, as a byte-level example is padded with spaces
  before its text;
- **the answer**: the last tokens that carry a character of the answer (from the
  tokenizer's offsets), so a leading space a token takes with the answer's first
  characters is scored with them and a token of whitespace alone before it is not;
- **the score**: exact match of those tokens under teacher forcing, as for byte-level
  models (``worker.evaluate``): an example is right when the argmax at every answer
  position is the answer's token;
- **the parts** of an answer that has several (RULER's string_match_all and
  string_match_part): each part is the tokens that carry one of its characters (from
  the same offsets), so a token that carries characters of two parts counts for both.

The generators are seeded as the task seeds them for byte-level models (by the task and
the length, and where a task seeds each example apart, by what it seeds it with), so
every run, and a rerun, scores the same examples; after an example the generator is
where the chosen draw left it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from core.catalog.tasks import TaskConfigError, task_info
from worker.data.base import Batch, Task
from worker.data.synthetic import (
    Example,
    ExampleMaker,
    SyntheticTask,
    answer_batch,
    part_spans,
    parts_of,
)
from worker.hf.tokens import tokenizer_fingerprint

if TYPE_CHECKING:
    from core.spec import EvalSpec

# The search for a byte budget gives up after this many tries (it takes a few).
MAX_TRIES = 64
# Where it ends between a budget too short and one too long, it tries this many bytes
# either side for an exact count.
NEAR = 4


@dataclass
class Rendered:
    """One example's text in tokens: its ids, how many of the last ones carry the answer,
    its group, and the generator's state after it was drawn."""

    ids: list[int]
    answer: int
    label: str
    after: Tensor
    # Where the answer has several parts: the (start, end) range of the answer's tokens
    # that carry each part's characters (a token carrying two parts' is in both).
    parts: tuple[tuple[int, int], ...] = ()


def answer_tokens(offsets: list[tuple[int, int]], start: int) -> int:
    """How many of the last tokens carry a character at or after ``start`` (the answer's
    first character), from their (start, end) character offsets."""
    count = 0
    for _, end in reversed(offsets):
        if end <= start:
            break
        count += 1
    return count


def part_tokens(
    offsets: list[tuple[int, int]], parts: list[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """For each part's (start, end) characters, the range of the answer's tokens (their
    character ``offsets``) that carry one of them."""
    spans = []
    for start, end in parts:
        hit = [i for i, (low, high) in enumerate(offsets) if low < end and high > start]
        if not hit:
            raise ValueError(f"no token of the answer carries characters {start}..{end}")
        spans.append((hit[0], hit[-1] + 1))
    return tuple(spans)


def end_of_text(tokenizer: Any) -> int:
    """The token put before an example too short in tokens: the end-of-text token (the
    beginning-of-text one where there is none; a space where neither exists)."""
    for token in (tokenizer.eos_token_id, tokenizer.bos_token_id):
        if token is not None:
            return int(token)
    return int(tokenizer.backend_tokenizer.encode(" ", add_special_tokens=False).ids[0])


class Tries:
    """One example drawn at several byte budgets, each from the generator's state before
    it, and rendered in tokens."""

    def __init__(self, task: TokenizedSynthetic, generator: torch.Generator, group: Any) -> None:
        self.task = task
        self.generator = generator
        self.group = group
        self.state = generator.get_state()
        self.seen: dict[int, Rendered | ValueError] = {}

    def at(self, budget: int) -> Rendered | ValueError:
        """The example at ``budget`` bytes, or why the task cannot build it (more distinct
        keys than there are)."""
        if budget not in self.seen:
            self.generator.set_state(self.state)
            try:
                drawn = self.task.task.example(budget, self.generator, self.group)
            except ValueError as err:
                self.seen[budget] = err
            else:
                after = self.generator.get_state()
                self.seen[budget] = self.task.render(*drawn[:3], after, parts_of(drawn))
        return self.seen[budget]

    def size(self, budget: int) -> int | None:
        """Tokens of the example at ``budget`` bytes (None: the task cannot build it)."""
        drawn = self.at(budget)
        return None if isinstance(drawn, ValueError) else len(drawn.ids)

    def fitted(self, low: int, high: int, length: int) -> int:
        """When ``low`` fits and ``high`` = low + 1 is too long: a budget within NEAR bytes
        of them that is exactly ``length + 1`` tokens (a count of tokens is not monotone
        in bytes: a word cut short can take more tokens than the whole word), else
        ``low``; an error where ``high`` cannot be built and ``low`` falls short (the
        task cannot grow)."""
        target = length + 1
        beyond = self.at(high)
        if isinstance(beyond, ValueError) and self.size(low) != target:
            raise TaskConfigError(
                f"task {self.task.name!r} at length {length} in the model's tokens needs a "
                f"longer text than it can build (at {high} bytes: {beyond})"
            )
        for step in range(1, NEAR + 1):
            for budget in (low - step, high + step):
                if budget >= self.task.shortest and self.size(budget) == target:
                    return budget
        return low


class TokenizedSynthetic(Task):
    """``task`` with its examples rendered in ``tokenizer``'s tokens."""

    def __init__(self, task: SyntheticTask, tokenizer: Any) -> None:
        self.task = task
        self.name = task.name
        self.metric = task.metric
        self.protocols = task.protocols
        self.backend = tokenizer.backend_tokenizer
        self.pad = end_of_text(tokenizer)
        self.shortest = task_info(task.name).min_length
        self.tokenizer = tokenizer_fingerprint(tokenizer)
        # The byte budget of each example drawn, by (length, examples per group).
        self.budgets: dict[tuple[int, int], list[int]] = {}

    @property
    def fingerprint(self) -> str:
        return f"{self.task.fingerprint}:tokens:{self.tokenizer}"

    def describe(self) -> dict[str, Any]:
        """What the examples were tokenized with, for provenance."""
        return {"tokenizer_sha256": self.tokenizer, "pad_token": self.pad}

    def train_batch(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise TaskConfigError("an hf: model is evaluated, never trained, on its tokens")

    def render(
        self, sequence: bytes, answer: int, label: str, after: Tensor, parts: tuple[Any, ...] = ()
    ) -> Rendered:
        """A task's example (``sequence``, its last ``answer`` bytes the answer, in
        ``parts`` where it has several) in tokens."""
        try:
            prompt = sequence[:-answer].decode("utf-8")
            text = prompt + sequence[-answer:].decode("utf-8")
        except UnicodeDecodeError:
            raise TaskConfigError(
                f"task {self.name!r}: its examples are not UTF-8 text; a model with its own "
                "tokenizer cannot read them"
            ) from None
        encoding = self.backend.encode(text, add_special_tokens=False)
        count = answer_tokens(encoding.offsets, len(prompt))
        spans = ()
        if len(parts) > 1:
            data = sequence[-answer:]
            chars = [
                (len(prompt) + len(data[:start].decode()), len(prompt) + len(data[:end].decode()))
                for start, end in part_spans(data, parts)
            ]
            spans = part_tokens(encoding.offsets[len(encoding.offsets) - count :], chars)
        return Rendered(list(encoding.ids), count, label, after, spans)

    def maker(self, length: int, per_group: int) -> ExampleMaker:
        """What draws the examples of one evaluation at ``length``, in order (the task's
        ``eval_examples`` calls it): each example's byte budget is searched for from the
        one the example before it took, and the budgets are kept, so the same examples
        are drawn again (another variant, a smaller batch) with one try each."""
        known = self.budgets.setdefault((length, per_group), [])
        drawn = 0

        def make(length: int, generator: torch.Generator, group: Any) -> Example:
            nonlocal drawn
            tries = Tries(self, generator, group)
            if drawn < len(known):
                budget = known[drawn]
            else:
                budget = self.search(tries, length, known[-1] if known else length)
                known.append(budget)
            drawn += 1
            chosen = tries.at(budget)
            assert isinstance(chosen, Rendered)
            generator.set_state(chosen.after)
            missing = length + 1 - len(chosen.ids)
            ids = torch.tensor([self.pad] * missing + chosen.ids, dtype=torch.long)
            return ids, chosen.answer, chosen.label, chosen.parts

        return make

    def search(self, tries: Tries, length: int, start: int) -> int:
        """The byte budget whose example is ``length + 1`` tokens, or else the largest
        that fits below the shortest too long one found: from ``start``, a step by the
        bytes per token seen while every try fits, then interpolation and bisection in
        turn between the two."""
        target = length + 1
        low: tuple[int, int] | None = None  # a budget that fits, and its tokens
        high: tuple[int, int | None] | None = None  # one too long (None: unbuildable)
        guess = max(start, self.shortest)
        for step in range(MAX_TRIES):
            size = tries.size(guess)
            if size == target:
                return guess
            if size is not None and size < target:
                low = (guess, size)
            else:
                high = (guess, size)
            if low is None:
                if guess == self.shortest:
                    break
                assert high is not None
                shrunk = round(high[0] * target / high[1]) if high[1] else high[0] // 2
                guess = max(self.shortest, min(high[0] - 1, shrunk))
            elif high is None:
                guess = low[0] + max(1, round((target - low[1]) * low[0] / low[1]))
            elif high[0] - low[0] <= 1:
                return tries.fitted(low[0], high[0], length)
            else:
                between = (low[0] + high[0]) // 2
                if step % 2 == 0 and high[1] is not None:
                    between = low[0] + (target - low[1]) * (high[0] - low[0]) // (high[1] - low[1])
                guess = min(high[0] - 1, max(low[0] + 1, between))
        if low is None:
            shortest = tries.size(self.shortest)
            raise TaskConfigError(
                f"task {self.name!r}: its shortest example is "
                f"{'more' if shortest is None else shortest - 1} tokens of the model's "
                f"tokenizer; length {length} cannot hold it"
            )
        return low[0]

    def check_plan(self, spec: EvalSpec, probe_length: int | None = None) -> None:
        """Before the first evaluation: the examples of the shortest and the longest
        length are drawn (a TaskConfigError names what does not fit), and their byte
        budgets kept for the evaluation."""
        per_group = self.task.per_group(spec.examples)
        for length in sorted({min(spec.lengths), max(spec.lengths)}):
            self.task.eval_examples(length, per_group, make=self.maker(length, per_group))

    def eval_batches(
        self,
        length: int,
        *,
        protocol: str,
        batch_size: int,
        tokens: int,
        examples: int,
        stride: int | None = None,
        longest: int | None = None,
    ) -> Iterator[Batch]:
        per_group = self.task.per_group(examples)
        rows = self.task.eval_examples(length, per_group, make=self.maker(length, per_group))
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            sequences = torch.stack([row[0] for row in chunk])
            yield answer_batch(
                sequences,
                [row[1] for row in chunk],
                [row[2] for row in chunk],
                [parts_of(row) for row in chunk],
            )
