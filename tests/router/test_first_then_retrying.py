"""``router.retries.first_then_retrying``: the first attempt without tenacity, the loop only
after a retryable failure — the same attempts, callbacks and errors as the loop alone."""

from __future__ import annotations

import asyncio

import pytest
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt

from router.retries import first_then_retrying


class Retryable(Exception):
    pass


class Fatal(Exception):
    pass


def _run(outcomes: list, reraise: bool = True, attempts: int = 3):
    """Attempt k returns or raises ``outcomes[k - 1]``; returns (result or exception,
    attempt numbers seen, before-sleep exceptions, loops made)."""
    seen, slept, loops = [], [], []

    async def attempt(n: int):
        seen.append(n)
        out = outcomes[n - 1]
        if isinstance(out, BaseException):
            raise out
        return out

    def retrying() -> AsyncRetrying:
        loops.append(1)
        return AsyncRetrying(retry=retry_if_exception(lambda e: isinstance(e, Retryable)),
                             stop=stop_after_attempt(attempts), reraise=reraise,
                             before_sleep=lambda s: slept.append(s.outcome.exception()))

    async def main():
        try:
            return await first_then_retrying(attempt, lambda e: isinstance(e, Retryable),
                                             retrying)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            return e

    return asyncio.run(main()), seen, slept, len(loops)


def test_first_success_makes_no_loop():
    assert _run(["ok"]) == ("ok", [1], [], 0)


def test_a_retryable_failure_continues_in_the_loop():
    first = Retryable("one")
    res, seen, slept, loops = _run([first, "ok"])
    assert (res, seen, loops) == ("ok", [1, 2], 1)
    assert slept == [first]  # the loop's before-sleep saw the direct attempt's failure


def test_a_refused_failure_is_raised_without_a_loop():
    fatal = Fatal("no")
    res, seen, slept, loops = _run([fatal])
    assert (res, seen, slept, loops) == (fatal, [1], [], 0)


def test_a_refused_failure_inside_the_loop_is_raised():
    fatal = Fatal("no")
    res, seen, _, loops = _run([Retryable("one"), fatal, "ok"])
    assert (res, seen, loops) == (fatal, [1, 2], 1)


@pytest.mark.parametrize("reraise", [True, False])
def test_attempts_are_counted_from_the_direct_one(reraise):
    errs = [Retryable(str(k)) for k in range(5)]
    res, seen, slept, _ = _run(errs, reraise=reraise, attempts=3)
    assert seen == [1, 2, 3] and slept == errs[:2]
    if reraise:
        assert res is errs[2]
    else:
        assert isinstance(res, RetryError) and res.last_attempt.exception() is errs[2]
