"""Incremental detokenisation and stop strings for streamed outputs (the API process side).

Token ids arrive from the instances a step at a time; :class:`IncrementalDetokenizer` turns them
into text deltas with a sliding window (vLLM's prefix/read offsets): only the last few tokens are
decoded per step, a delta is released only when it does not end in a partial UTF-8 character, and
cost per token stays constant.

Stop strings (OpenAI ``stop``): the accumulated text is searched; on a match the text is cut
before the stop string (after it with vLLM's ``include_stop_str_in_output``), the request finishes
with ``"stop"``, the matched string becomes the choice's ``stop_reason`` and the router cancels it
on its instance. As vLLM, stop strings are looked for only once ``min_tokens`` tokens have arrived. While streaming, the last ``len(longest stop) - 1`` characters are held back, so a stop
string split across steps is never partly sent.

A model without a tokenizer yields empty text (clients read ``token_ids`` with
``return_token_ids``).
"""

from __future__ import annotations


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "ids", "_prefix", "_read", "text", "_sent", "stop", "_hold", "stopped", "skip_special",
                 "min_tokens", "include_stop", "stop_string")

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special: bool = True, min_tokens: int = 0,
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""
        self._sent = 0
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.stopped = False
        self.skip_special = skip_special
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.stop_string: str | None = None      # the stop string that ended the text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: list[int]) -> None:
        """Append tokens; updates ``text`` (cut at a stop string, setting ``stopped``)."""
        if self.stopped or not token_ids:
            return
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            start = max(0, len(self.text) - self._hold)
            self.text += delta
            if self.stop and len(self.ids) >= self.min_tokens:
                hits = [(p, s) for s in self.stop if (p := self.text.find(s, start)) >= 0]
                if hits:
                    at, self.stop_string = min(hits, key=lambda h: (h[0], -len(h[1])))
                    self.text = self.text[:at + len(self.stop_string) if self.include_stop else at]
                    self.stopped = True

    def delta(self, final: bool = False) -> str:
        """Text not yet sent that is safe to send (everything when ``final``)."""
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._hold)
        out = self.text[self._sent:end]
        self._sent = end
        return out


def token_text(tokenizer, token_id: int) -> str:
    """A display string for one token in logprob listings (vLLM's ``token_id:N`` without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def stop_reason(detok: IncrementalDetokenizer, finish: str | None, stop_token_ids: tuple[int, ...]) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or the ``stop_token_ids`` entry that ended the
    choice; None for EOS, a length limit, or a choice still running."""
    if finish != "stop":
        return None
    if detok.stop_string is not None:
        return detok.stop_string
    if detok.ids and detok.ids[-1] in stop_token_ids:
        return detok.ids[-1]
    return None
