#!/usr/bin/env python3
"""A Keel step machine served from Python over `keel serve`'s worker protocol.

Only the standard library: poll for a task, run the step, complete it with an outcome
(or fail it), heartbeat while a step is long. Serves the machine `greeter` v1, whose one
step `greet` answers with a greeting for the context's `name`; a context with
`"refuse": true` fails the step for good (it ends in the dead-letter queue).

    python3 examples/http-worker/worker.py --base http://127.0.0.1:7878 --tasks 1

A server started with a tokens file wants `--token` (or `KEEL_TOKEN` in the
environment): it is sent as `Authorization: Bearer <token>`.

Each finished task prints one JSON line: {"task": id, "status": HTTP status, ...}.
A 409 means the lease was lost (it expired and another worker took the task): the
result is dropped, which is what a worker must do. A 422 from complete or fail means
the store refused the result for good (say, a unique key another instance holds) and
the step was failed instead, through its retry and dead-letter settings; the answer's
`status` and `error` say what became of it. Drop the result and poll again, as for
409. A 429 on a poll means the server already holds as many waiting polls as it
allows: wait as long as `Retry-After` says, then poll again.

A task carries `timeout_ms`, the step's timeout by the server's configuration file:
the server cannot stop a remote step, so a worker whose steps can run long stops the
step then and fails it. This example's step returns at once, so it does not need to.

When the server cannot be reached or answers 502, 503 or 504, the worker waits (a
backoff doubling up to BACKOFF_MAX seconds) and tries again: a poll polls again, and a
complete or fail is sent again while the lease lasts, because the lease is still the
worker's (a retry whose first try did commit gets 409). A 400, 401 or 403 will not go
away by trying again: the worker prints why and exits with status 1. With
`--heartbeat`, it extends the lease about every third of `--lease-ms` during the pause;
a 409 (or 404) there means the lease (or the task) is gone, so the task is dropped
without running the step.
"""

import argparse
import http.client
import json
import os
import random
import sys
import time
import urllib.error
import urllib.request

# Empty polls (204, 429 from a busy server, or no answer) in a row before the worker
# gives up.
EMPTY_POLLS_MAX = 100
# The first and the longest wait, in seconds, before trying again after no answer or a
# 502/503/504; each wait in a row doubles it.
BACKOFF_FIRST = 0.25
BACKOFF_MAX = 10.0
# Answers to try again after, and answers that will not change by trying again.
TRY_AGAIN = (None, 502, 503, 504)
FATAL = (400, 401, 403)


def call(args, path, body):
    """POSTs JSON; returns (status, parsed body or None, the reply's headers).

    The status is None when no answer came (refused, reset, timed out); the body is then
    `{"error": …}`, as it is for an answer that is not JSON (a proxy's error page). The
    headers are an `http.client.HTTPMessage`, whose `get` ignores case (the server sends
    `retry-after`, a proxy may send `Retry-After`)."""
    headers = {"Content-Type": "application/json"}
    if args.token:
        headers["Authorization"] = "Bearer " + args.token
    request = urllib.request.Request(
        args.base + path, data=json.dumps(body).encode(), headers=headers, method="POST"
    )
    status, reply = None, {}
    try:
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, reply = response.status, response.headers
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            status, reply = error.code, error.headers
            text = error.read().decode()
        return status, json.loads(text) if text else None, reply
    except ValueError as error:  # not JSON, or not UTF-8
        return status, {"error": "the answer is not JSON: %s" % error}, reply
    except (OSError, http.client.HTTPException) as error:  # URLError is an OSError
        return None, {"error": "no answer: %s" % error}, {}


def backoff(delay):
    """Sleeps about `delay` seconds (less a random part, so that workers cut off together
    do not all come back at once) and returns the next, longer delay."""
    time.sleep(delay * random.uniform(0.5, 1.0))
    return min(delay * 2, BACKOFF_MAX)


def fatal(what, status, body):
    print(json.dumps({"error": what, "status": status, "body": body}), flush=True)
    return 1


def log(what, status, body):
    """A call to try again: said on stderr, which keeps stdout to one line a task."""
    print(json.dumps({"retrying": what, "status": status, "body": body}), file=sys.stderr,
          flush=True)


def step(task):
    """The machine's logic: an outcome, or an error message for a non-retryable failure."""
    context = task["context"]
    if task["step"] != "greet":
        return None, "unknown step %r" % task["step"]
    if context.get("refuse"):
        return None, "refused by the Python worker"
    name = context.get("name", "world")
    return {"type": "done", "result": {"greeting": "hello, %s" % name, "by": "python"}}, None


def pause(args, task, ident, lease_ends):
    """Sleeps `--pause-ms`, heartbeating about every third of the lease with
    `--heartbeat`. Returns (None, lease end) to go on, or the (status, body) that ends
    the task: 409, the lease is lost; 404, the task is gone; a FATAL status."""
    end = time.monotonic() + args.pause_ms / 1000
    every = args.lease_ms / 3000
    beat = time.monotonic() + every
    while time.monotonic() < end:
        time.sleep(max(0, min(0.1, end - time.monotonic())))
        if not args.heartbeat or time.monotonic() < beat:
            continue
        sent = time.monotonic()
        status, answer, _ = call(args, "/v1/worker/tasks/%d/heartbeat" % task["id"],
                                 dict(ident, lease_ms=args.lease_ms))
        if status == 200:
            lease_ends = sent + (answer or {}).get("lease_ms", args.lease_ms) / 1000
            beat = sent + every
        elif status in (404, 409) or status in FATAL:
            return (status, answer), lease_ends
        else:
            # 503 or no answer: the lease is still held until it ends; try again soon.
            log("heartbeat", status, answer)
            beat = time.monotonic() + min(every, 1.0)
    return None, lease_ends


def finish(args, path, body, lease_ends):
    """Sends a complete or fail, again after a backoff while the answer is TRY_AGAIN and
    the lease lasts. Returns the last (status, body)."""
    delay = BACKOFF_FIRST
    while True:
        status, answer, _ = call(args, path, body)
        if status not in TRY_AGAIN or time.monotonic() + delay >= lease_ends:
            return status, answer
        log(path, status, answer)
        delay = backoff(delay)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--token", default=os.environ.get("KEEL_TOKEN"),
                        help="bearer token for a server with tokens (default: $KEEL_TOKEN)")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--worker", default="python-1")
    parser.add_argument("--tasks", type=int, default=1,
                        help="stop after this many tasks (or after %d empty polls in a row)"
                        % EMPTY_POLLS_MAX)
    parser.add_argument("--lease-ms", type=int, default=30000)
    parser.add_argument("--wait-ms", type=int, default=5000)
    parser.add_argument("--pause-ms", type=int, default=0, help="sleep inside each step")
    parser.add_argument("--heartbeat", action="store_true",
                        help="heartbeat during the pause, about every third of the lease")
    args = parser.parse_args()

    done = 0
    # Tasks whose complete or fail got no answer saying it landed before the lease ended.
    unconfirmed = 0
    # Polls in a row that found no task: a worker that never gets one gives up after
    # EMPTY_POLLS_MAX of them; every task served starts the count again.
    empty = 0
    delay = BACKOFF_FIRST
    while done < args.tasks:
        if empty >= EMPTY_POLLS_MAX:
            print(json.dumps({"error": "no task after %d empty polls" % EMPTY_POLLS_MAX}),
                  flush=True)
            return 1
        sent = time.monotonic()
        status, task, reply = call(args, "/v1/worker/tasks/poll", {
            "worker": args.worker,
            "namespace": args.namespace,
            "machines": [{"name": "greeter", "version": 1}],
            "lease_ms": args.lease_ms,
            "wait_ms": args.wait_ms,
        })
        if status in TRY_AGAIN:
            # Restarting, overloaded, or out of reach: wait longer each time, then poll again.
            empty += 1
            log("poll", status, task)
            delay = backoff(delay)
            continue
        delay = BACKOFF_FIRST
        if status == 204:
            empty += 1
            continue
        if status == 429:
            # Too many polls wait on this server: back off as it asks (at most a minute).
            empty += 1
            retry_after = (reply.get("Retry-After") or "1").strip()
            time.sleep(min(int(retry_after) if retry_after.isdigit() else 1, 60))
            continue
        if status != 200:
            return fatal("poll failed", status, task)
        empty = 0
        # The lease began after the poll was sent: counting from then errs on the short side.
        lease_ends = sent + args.lease_ms / 1000
        ident = {"worker": args.worker, "token": task["token"]}
        ended, lease_ends = pause(args, task, ident, lease_ends)
        if ended is not None:
            status, answer = ended
            if status in FATAL:
                return fatal("heartbeat failed", status, answer)
            # 409 or 404: the lease or the task is gone, so the step is not run.
        else:
            outcome, error = step(task)
            # `seen`: the signals the step was handed; only those can be consumed.
            seen = [signal["id"] for signal in task["inbox"]]
            if outcome is not None:
                status, answer = finish(args, "/v1/worker/tasks/%d/complete" % task["id"],
                                        dict(ident, outcome=outcome, seen=seen), lease_ends)
            else:
                status, answer = finish(args, "/v1/worker/tasks/%d/fail" % task["id"],
                                        dict(ident, error=error, retryable=False, seen=seen),
                                        lease_ends)
            if status in FATAL:
                return fatal("complete or fail refused", status, answer)
            if status in TRY_AGAIN:
                # No answer said the result landed before the lease ran out: it may have
                # (an answer lost on the way back) or not (the task then comes back to a
                # poll once its lease ends). Said as an error, and in the exit status.
                print(json.dumps({"error": "result not confirmed", "task": task["id"],
                                  "status": status, "answer": answer}), flush=True)
                unconfirmed += 1
                done += 1
                continue
        print(json.dumps({"task": task["id"], "token": task["token"], "status": status,
                          "answer": answer}), flush=True)
        done += 1
    return 1 if unconfirmed else 0


if __name__ == "__main__":
    sys.exit(main())
