"""The continuous engine's scheduler: the samples waiting and the rows running, which of them a step admits, which
end and when their rows are given back (harness/rft/engine.py runs it).

    python -c "from harness.rft.scheduler import Scheduler; help(Scheduler)"

Host-side bookkeeping only (no model call): a call's n samples of each prompt wait in order; those admitted take
the free rows, a prompt prefilled once for all its samples (its prefill kept while some of its samples wait); each
token read is appended to its sequence, which ends at an ending id, rft.max_new_tokens or a stop string (`Ends`),
and the running rows move to the front of the cache after each read (`compact`).
"""

from __future__ import annotations

from typing import Optional

from harness.rft.contract import Completion, OnDone
from harness.rft.decode import StopStrings, on
from harness.rft.stats import Stats


class Seq:
    """One sample in flight: prompt i, sample j, its row, its tokens read so far and its position (host side)."""

    __slots__ = ("i", "j", "row", "tokens", "pos", "done")

    def __init__(self, i: int, j: int, row: int, pos: int) -> None:
        self.i, self.j, self.row, self.pos, self.tokens, self.done = i, j, row, pos, [], False


class Ends:
    """Whether a sequence ends with its newest token `t`: an ending id (`eos`), `limit` tokens, or a stop string
    completed (checked only for the tokens that can complete one: StopStrings.enders, a set lookup)."""

    def __init__(self, eos, limit: int, stopped: StopStrings) -> None:
        self.eos, self.limit, self.stopped = set(eos), limit, stopped
        self.enders = stopped.enders() if stopped.strings else frozenset()  # None: any token can

    def __call__(self, t: int, tokens: list[int]) -> bool:
        return t in self.eos or len(tokens) >= self.limit or \
            ((self.enders is None or t in self.enders) and self.stopped.in_tail(tokens))


class Scheduler:
    """One generate() call's samples: `waiting` (in order), `rows` (the sequences in flight, rows 0..len-1),
    `results` (each prompt's completions as they end; `on_done(i, completions)` once prompt i's n have)."""

    def __init__(self, prompts: list[list[int]], n: int, ends: Ends, stats: Stats,
                 on_done: Optional[OnDone] = None) -> None:
        self.ids, self.n, self.ends, self.stats, self.on_done = [list(p) for p in prompts], n, ends, stats, on_done
        self.results: list[list] = [[None] * n for _ in prompts]
        self.left = [n] * len(prompts)  # samples of each prompt not yet ended
        self.waiting = [(i, j) for i in range(len(prompts)) for j in range(n)]
        self.waiting.reverse()  # pop() takes the next in order
        self.prompt_kv: dict = {}  # prompt index -> (prefill, index in it) while some of its samples wait
        self.rows: list[Seq] = []

    def busy(self) -> bool:
        """Samples waiting or running."""
        return bool(self.waiting or self.rows)

    def wants_rows(self, slots: int) -> bool:
        return bool(self.waiting) and len(self.rows) < slots

    # ------------------------------------------------------------------------------------------- admissions
    def take(self, slots: int) -> list[tuple[int, int]]:
        """The waiting samples that the free rows of `slots` take, in order."""
        taken = []
        while self.waiting and len(self.rows) + len(taken) < slots:
            taken.append(self.waiting.pop())
        return taken

    def unprefilled(self, taken: list) -> list[int]:
        """The prompts of `taken` with no prefill kept (to be prefilled together)."""
        return sorted({i for i, _ in taken if i not in self.prompt_kv})

    def put_back(self, taken: list) -> None:
        """`taken` waits again (their prefill ran out of memory)."""
        self.waiting.extend(reversed(taken))

    def prefilled(self, new: list[int], pre: tuple) -> None:
        for k, i in enumerate(new):
            self.prompt_kv[i] = (pre, k)

    def place(self, taken: list) -> list[tuple]:
        """`taken` as running sequences in the next rows, grouped by prefill: [(prefill, its sequences, their
        indices in it)]; a prompt's prefill is let go with its last sample."""
        groups: dict = {}  # id(prefill) -> (prefill, sequences, indices in it)
        for i, j in taken:
            pre, k = self.prompt_kv[i]
            if j == self.n - 1:
                del self.prompt_kv[i]
            s = Seq(i, j, len(self.rows), len(self.ids[i]))
            self.rows.append(s)
            g = groups.setdefault(id(pre), (pre, [], []))
            g[1].append(s)
            g[2].append(k)
        return list(groups.values())

    # ------------------------------------------------------------------------------------------- tokens read
    def read(self, seqs: list, values: list[int]) -> list[Seq]:
        """A step's (or an admission's) picked tokens, one per row (None: a padding row): appended; the sequences
        that ended, finished."""
        ended = []
        for s, t in zip(seqs, values):
            if s is None or s.done:
                continue
            s.tokens.append(t)
            if self.ends(t, s.tokens):
                self.finish(s)
                ended.append(s)
        return ended

    def finish(self, s: Seq) -> None:
        st = self.stats
        s.done = True
        st.sequences += 1
        st.tokens += len(s.tokens)
        st.lengths.append(len(s.tokens))
        st.used_slot_steps += len(s.tokens) - 1  # the first token comes from the prefill
        self.results[s.i][s.j] = Completion(tuple(s.tokens))
        self.left[s.i] -= 1
        if self.left[s.i] == 0 and self.on_done is not None:
            self.on_done(s.i, self.results[s.i])

    def compact(self, cache, ended: list[Seq]) -> None:
        """The rows of the running sequences move to the front (one copy for all), freed rows start at position 0."""
        rows = self.rows
        keep = [s for s in rows if not s.done]
        holes = sorted(s.row for s in ended if s.row < len(keep))
        movers = [s for s in keep if s.row >= len(keep)]
        if movers:
            cache.move([s.row for s in movers], holes, min(cache.width, max(s.pos for s in movers) + 1))
            for s, h in zip(movers, holes):
                s.row = h
        cache.pos[len(keep):len(rows)] = 0
        rows[:] = sorted(keep, key=lambda s: s.row)

    def restart(self) -> None:
        """The sequences in flight wait again, from their start (out of memory: the cache is replaced); every
        prompt is prefilled again when its samples are admitted."""
        for s in self.rows:
            self.waiting.append((s.i, s.j))
        self.waiting.sort(reverse=True)
        self.prompt_kv.clear()
        self.rows.clear()


def rows_on(device, seqs: list[Seq]):
    """The rows of `seqs` as a device tensor (`decode.on`: no wait)."""
    return on(device, [s.row for s in seqs])
