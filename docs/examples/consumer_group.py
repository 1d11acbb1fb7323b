"""Every final transcript, at least once, shared by the workers of a consumer group (docs/events.md).
Run several copies with different consumer names: each entry goes to one of them.
Usage: python consumer_group.py [redis-url] [consumer-name]"""

import contextlib
import sys

import redis

url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
me = sys.argv[2] if len(sys.argv) > 2 else "worker-1"
r = redis.Redis.from_url(url, decode_responses=True)
stream, group = "ttg:transcripts", "transcripts"
with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: another worker created it
    r.xgroup_create(stream, group, id="0", mkstream=True)  # "0": what is in the stream already, too
last_seq = {}  # (call_id, leg) -> seq: skip an event delivered again (a worker crashed before XACK)
while True:
    for _, entries in r.xreadgroup(group, me, {stream: ">"}, count=100, block=5000) or []:
        for entry_id, ev in entries:
            key, seq = (ev["call_id"], ev["leg"]), int(ev["seq"])
            if ev["type"] == "final" and seq > last_seq.get(key, 0):
                print(f"{ev['call_id']} [{ev['start_ms']}-{ev['end_ms']} ms] {ev['text']}", flush=True)
            last_seq[key] = max(seq, last_seq.get(key, 0))
            r.xack(stream, group, entry_id)
