"""Thin wrappers around a REAL backend for stage tests: one counts requests, one records what the
stage received, one simulates a crash (failure injection) after some results were delivered."""
from __future__ import annotations


class SimulatedKill(BaseException):
    """Stands in for SIGKILL inside one process (BaseException: nothing may swallow it)."""


class Counting:
    def __init__(self, inner):
        self.inner, self.name, self.calls, self.requests = inner, inner.name, 0, 0

    def chat_many(self, requests, progress=None, on_result=None):
        self.calls += 1
        self.requests += len(requests)
        return self.inner.chat_many(requests, progress=progress, on_result=on_result)

    def context_window(self):
        return self.inner.context_window()

    def prompt_tokens(self, request):
        return self.inner.prompt_tokens(request)


class CrashAfter(Counting):
    """Delivers ``n`` results to the stage, then dies like a killed process (fake crash)."""

    def __init__(self, inner, n: int):
        super().__init__(inner)
        self.n = n

    def chat_many(self, requests, progress=None, on_result=None):
        delivered = 0

        def deliver(i, result):
            nonlocal delivered
            if delivered == self.n:
                raise SimulatedKill()
            delivered += 1
            on_result(i, result)

        return super().chat_many(requests, progress=progress, on_result=deliver)


class Recording(Counting):
    """Records each result the stage actually received, by request seed (stages seed per request)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.delivered: dict[int, object] = {}

    def chat_many(self, requests, progress=None, on_result=None):
        def record(i, result):
            on_result(i, result)  # a fake crash raises here: that result never reached the stage
            self.delivered[requests[i].seed] = result

        return super().chat_many(requests, progress=progress, on_result=record)
