"""Chat templates held to account: compiled when the server starts, test-rendered once the
tokenizer is loaded (a broken template stops start-up with one line instead of failing every
chat request later), and every per-request render bounded in time and size.

The time bound: Jinja compiles a template to Python code (file name ``<template>``), so while a
render runs, a trace function installed on the rendering thread alone (``sys.settrace``) sees each
line of template code execute and raises :class:`TemplateOverrun` once the deadline has passed;
the exception unwinds the render like any template error and the thread is free again. Code
outside templates gets no per-line tracing (only the call event), so the cost is small. A loop
in a template therefore fails its request with a 400 after ``timeout`` seconds instead of holding
a parse thread for good (which also kept SIGTERM from ending the server: the pool's threads are
joined at exit). The size bound: the rendered text may not exceed the prompt's character budget.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Any

TEMPLATE_FILE = "<template>"          # the file name of Jinja's compiled template code
DEFAULT_RENDER_TIMEOUT = 2.0          # seconds one render may take
PROBE_MESSAGES = [{"role": "user", "content": "Hello!"}]


class TemplateOverrun(Exception):
    """A render ran past its deadline."""


@contextmanager
def render_deadline(timeout: float):
    """Within the block, template code run by this thread raises :class:`TemplateOverrun` after
    ``timeout`` seconds. The thread's previous trace function is restored after."""
    deadline = time.monotonic() + timeout

    def local(frame, event, arg):
        if event == "line" and time.monotonic() > deadline:
            raise TemplateOverrun(f"the chat template ran longer than {timeout:g} s")
        return local

    def global_(frame, event, arg):
        return local if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        yield
    finally:
        sys.settrace(previous)


def compile_check(text: str) -> None:
    """``ValueError`` (one line) when ``text`` is not a Jinja template that compiles."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        if "generation" in str(exc.message):         # transformers' own {% generation %} tag: probed later
            return
        raise ValueError(f"--chat-template does not compile: line {exc.lineno}: {exc.message}") from None


def probe_render(tokenizer: Any, template: str | None, timeout: float = DEFAULT_RENDER_TIMEOUT) -> None:
    """Render a one-message conversation with ``template`` (else the tokenizer's own) as a request
    would; ``ValueError`` with one line when it fails, overruns or produces no text."""
    if tokenizer is None or not (template or getattr(tokenizer, "chat_template", None)):
        return
    kwargs = {"chat_template": template} if template else {}
    try:
        with render_deadline(timeout):
            text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False, add_generation_prompt=True,
                                                 **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of the template is reported as one line
        what = "--chat-template" if template else "the tokenizer's chat template"
        raise ValueError(f"{what} fails on a one-message conversation: "
                         f"{' '.join(str(exc).split())[:200] or type(exc).__name__}") from None
    if not isinstance(text, str) or not text:
        raise ValueError("the chat template renders a one-message conversation as no text")
