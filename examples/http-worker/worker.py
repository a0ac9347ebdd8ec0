#!/usr/bin/env python3
"""A Keel step machine served from Python over `keel serve`'s worker protocol.

Only the standard library: poll for a task, run the step, complete it with an outcome
(or fail it), heartbeat while a step is long. Serves the machine `greeter` v1, whose one
step `greet` answers with a greeting for the context's `name`; a context with
`"refuse": true` fails the step for good (it ends in the dead-letter queue).

    python3 examples/http-worker/worker.py --base http://127.0.0.1:7878 --tasks 1

Each finished task prints one JSON line: {"task": id, "status": HTTP status, ...}.
A 409 means the lease was lost (it expired and another worker took the task): the
result is dropped, which is what a worker must do. A 422 from complete or fail means
the store refused the result for good (say, a unique key another instance holds) and
the step was failed instead, through its retry and dead-letter settings; the answer's
`status` and `error` say what became of it. Drop the result and poll again, as for
409. A 429 on a poll means the server already holds as many waiting polls as it
allows: wait as long as `Retry-After` says, then poll again.
"""

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

# Empty polls (204, or 429 from a busy server) in a row before the worker gives up.
EMPTY_POLLS_MAX = 100


def call(base, path, body):
    """POSTs JSON; returns (status, parsed body or None, the reply's headers).

    The headers are an `http.client.HTTPMessage`, whose `get` ignores case (the server
    sends `retry-after`, a proxy may send `Retry-After`)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text else None, response.headers
    except urllib.error.HTTPError as error:
        text = error.read().decode()
        return error.code, json.loads(text) if text else None, error.headers


def step(task):
    """The machine's logic: an outcome, or an error message for a non-retryable failure."""
    context = task["context"]
    if task["step"] != "greet":
        return None, "unknown step %r" % task["step"]
    if context.get("refuse"):
        return None, "refused by the Python worker"
    name = context.get("name", "world")
    return {"type": "done", "result": {"greeting": "hello, %s" % name, "by": "python"}}, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--worker", default="python-1")
    parser.add_argument("--tasks", type=int, default=1,
                        help="stop after this many tasks (or after %d empty polls in a row)"
                        % EMPTY_POLLS_MAX)
    parser.add_argument("--lease-ms", type=int, default=30000)
    parser.add_argument("--wait-ms", type=int, default=5000)
    parser.add_argument("--pause-ms", type=int, default=0, help="sleep inside each step")
    parser.add_argument("--heartbeat", action="store_true", help="heartbeat during the pause")
    args = parser.parse_args()

    done = 0
    # Polls in a row that found no task: a worker that never gets one gives up after
    # EMPTY_POLLS_MAX of them; every task served starts the count again.
    empty = 0
    while done < args.tasks:
        if empty >= EMPTY_POLLS_MAX:
            print(json.dumps({"error": "no task after %d empty polls" % EMPTY_POLLS_MAX}),
                  flush=True)
            return 1
        status, task, reply = call(args.base, "/v1/worker/tasks/poll", {
            "worker": args.worker,
            "namespace": args.namespace,
            "machines": [{"name": "greeter", "version": 1}],
            "lease_ms": args.lease_ms,
            "wait_ms": args.wait_ms,
        })
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
            print(json.dumps({"error": "poll failed", "status": status, "body": task}), flush=True)
            return 1
        empty = 0
        ident = {"worker": args.worker, "token": task["token"]}
        paused = 0
        while paused < args.pause_ms:
            time.sleep(0.1)
            paused += 100
            if args.heartbeat:
                hb, _, _ = call(args.base, "/v1/worker/tasks/%d/heartbeat" % task["id"],
                                dict(ident, lease_ms=args.lease_ms))
                if hb != 200:
                    break
        outcome, error = step(task)
        if outcome is not None:
            # `seen`: the signals the step was handed; only those can be consumed.
            seen = [signal["id"] for signal in task["inbox"]]
            status, answer, _ = call(args.base, "/v1/worker/tasks/%d/complete" % task["id"],
                                     dict(ident, outcome=outcome, seen=seen))
        else:
            status, answer, _ = call(args.base, "/v1/worker/tasks/%d/fail" % task["id"],
                                     dict(ident, error=error, retryable=False,
                                          seen=[signal["id"] for signal in task["inbox"]]))
        print(json.dumps({"task": task["id"], "token": task["token"], "status": status,
                          "answer": answer}), flush=True)
        done += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
