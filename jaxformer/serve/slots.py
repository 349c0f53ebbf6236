"""A running request's host-side state: its tokens, pages, and the text it has streamed.

Text and stop strings. With a tokenizer, each event carries the text its token
adds (`TokenEvent.text`), computed from the decoded text of all generated
tokens so far (so multi-token characters come out whole). Text is held back
while it could still be the start of a stop string or ends inside an
unfinished UTF-8 character; a stop string found ends the request, and the text
before it is the last to stream (the stop string itself never does).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from jaxformer.serve.handle import Handle
from jaxformer.serve.pages import PageTable
from jaxformer.serve.request import FinishReason, TokenEvent

REPLACEMENT = "\ufffd"  # what decoding an unfinished UTF-8 character gives


@dataclasses.dataclass
class Slot:
    """One request in a slot. `tokens` = prompt then generated ids; the first `cached`
    have their keys/values in the pool; `pending` is the last pick, not yet fed."""
    handle: Handle
    table: PageTable
    tokens: list[int]
    prompt_len: int
    reserve: int                      # pages it may still take (admission accounting)
    cached: int = 0
    pending: Optional[int] = None
    generated: int = 0
    streamed_text: str = ""
    stopped_at: Optional[int] = None  # where in the text a stop string starts
    prompt_logprobs: list = dataclasses.field(default_factory=list)  # echo: (lp, top) of 1..

    @property
    def request(self):
        return self.handle.request

    @property
    def prefilling(self) -> bool:
        return self.cached < self.prompt_len

    def new_text(self, decode: Optional[Callable], final: bool) -> str:
        """The text the generated tokens add since the last call (see module docstring);
        sets `stopped_at` when a stop string shows up."""
        if decode is None:
            return ""
        full = decode(self.tokens[self.prompt_len:])
        stops = self.request.params.stop
        hits = [i for i in (full.find(s, max(0, len(self.streamed_text) - len(s) + 1))
                            for s in stops) if i >= 0]
        if hits:
            self.stopped_at = min(hits)
            end = self.stopped_at
        elif final:
            end = len(full)
        else:
            end = len(full) - held_back(full, stops)
        delta = full[len(self.streamed_text):max(end, len(self.streamed_text))]
        self.streamed_text += delta
        return delta


def held_back(text: str, stops) -> int:
    """Characters at the end of `text` not to stream yet: an unfinished character, or
    the longest tail that a stop string starts with."""
    if text.endswith(REPLACEMENT):
        return 1
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-n:]):
                longest = n
                break
    return longest


def token_event(slot: Slot, token: Optional[int], logprob=None, top=(), *,
                finish: Optional[FinishReason] = None, text: str = "",
                prompt: bool = False, stopped_by: Optional[tuple] = None) -> TokenEvent:
    return TokenEvent(token=token, logprob=None if logprob is None else float(logprob),
                      top_logprobs=tuple(top), finish_reason=finish, text=text, prompt=prompt,
                      stopped_by=stopped_by)
