"""The Redis side of the sink: one Lua script applies a whole batch, in order, each event at most once.

Why a script: Redis 7.0 has no idempotent XADD (IDMP is 8.6), and a retry after a lost reply, a
replay after a restart, or a crash between XADD and the spool cursor all send a record again. The
script keeps, per call+leg, the last stored seq (`<stream>:seq:<call_id>:<leg>`, with a TTL) and
stores a record only when its seq is above it. Records of a call+leg always arrive in seq order
(see core.py), so "above the last" is exactly "not stored yet". Scripts run atomically, and one
script per batch gives one round trip per tick and an exact answer: which records were stored, which
Redis already had, and the error that stopped the batch (nothing after it is tried, so order holds).

Keys written (all derived from the global stream name S):
  S                       the global stream (the contract), XADD MAXLEN ~ maxlen, auto IDs
  S:seq:<call>:<leg>      the guard: last stored seq, expires after guard_ttl_s
  S:calls (configurable)  calls index: call_start/call_end only, plus `entry_id` in S; MAXLEN ~
  S:call:<call>:<leg>     optional per-call stream, explicit ID `<seq>-0`, expires call_ttl_s after
                          its last event (a second guard: Redis refuses an ID not above the top)
Not for Redis Cluster (the keys of a batch live in different slots).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sink.core import BatchOutcome
from gateway.sink.spool import Record

INDEXED_TYPES = frozenset({"call_start", "call_end"})

# KEYS: [1] global stream, [2] calls index, then per event: guard key, per-call stream key.
# ARGV: [1] MAXLEN ~ of the global stream, [2] of the index (0 = no index), [3] guard TTL s,
#       [4] per-call stream TTL s (0 = no per-call streams); then per event: seq, indexed (0/1), and
#       its fields as one JSON array [name, value, name, value ...] (three arguments per event
#       instead of ~30 halves the client's packing time; cjson keeps UTF-8 and the field order).
# Returns one string per event processed: its entry ID in the global stream, or "" when Redis already
# had it; an event that fails gives "!" .. error, and is the last element.
LUA_APPLY_BATCH = """
local maxlen, index_maxlen = ARGV[1], tonumber(ARGV[2])
local guard_ttl, call_ttl = ARGV[3], tonumber(ARGV[4])
local out = {}
local a, k = 5, 3
while k <= #KEYS do
  local guard, percall = KEYS[k], KEYS[k + 1]
  local seq_s, indexed, fields = ARGV[a], ARGV[a + 1], cjson.decode(ARGV[a + 2])
  a, k = a + 3, k + 2
  local seq = tonumber(seq_s)
  local last = redis.pcall('GET', guard)
  if type(last) == 'table' and last.err then
    out[#out + 1] = '!' .. last.err
    return out
  end
  local stored = false
  if seq <= (tonumber(last or '0') or 0) then
    out[#out + 1] = ''
  else
    local pid = nil
    if call_ttl > 0 then
      pid = redis.pcall('XADD', percall, seq_s .. '-0', unpack(fields))
      if type(pid) == 'table' then
        if string.find(pid.err, 'equal or smaller', 1, true) then
          pid = false  -- the per-call stream has it: the guard had expired; a duplicate
        else
          out[#out + 1] = '!' .. pid.err
          return out
        end
      end
    end
    if pid == false then
      redis.pcall('SET', guard, seq_s, 'EX', guard_ttl)
      out[#out + 1] = ''
    else
      local id = redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', unpack(fields))
      if type(id) == 'table' then
        if pid then redis.pcall('XDEL', percall, pid) end
        out[#out + 1] = '!' .. id.err
        return out
      end
      -- The event is stored; what follows is bookkeeping and must not undo it.
      redis.pcall('SET', guard, seq_s, 'EX', guard_ttl)
      if pid then redis.pcall('EXPIRE', percall, call_ttl) end
      if indexed == '1' and index_maxlen > 0 then
        redis.pcall('XADD', KEYS[2], 'MAXLEN', '~', index_maxlen, '*', 'entry_id', id, unpack(fields))
      end
      out[#out + 1] = id
    end
  end
end
return out
"""


@dataclass(frozen=True, slots=True)
class StreamLayout:
    """Key names and limits (from RedisSettings)."""

    stream: str = "ttg:transcripts"
    maxlen: int = 1_000_000
    calls_stream: str = "ttg:calls"  # empty: no calls index
    calls_maxlen: int = 100_000
    guard_ttl_s: int = 86_400
    per_call_ttl_s: int = 0  # 0: no per-call streams

    def guard_key(self, call_id: str, leg: str) -> str:
        return f"{self.stream}:seq:{call_id}:{leg}"

    def call_stream(self, call_id: str, leg: str) -> str:
        return f"{self.stream}:call:{call_id}:{leg}"


def batch_call(layout: StreamLayout, records: Sequence[Record]) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of one script call for `records`."""
    keys = [layout.stream, layout.calls_stream or layout.stream]
    args = [
        str(layout.maxlen),
        str(layout.calls_maxlen if layout.calls_stream else 0),
        str(layout.guard_ttl_s),
        str(layout.per_call_ttl_s),
    ]
    for rec in records:
        keys.append(layout.guard_key(rec.call_id, rec.leg))
        keys.append(layout.call_stream(rec.call_id, rec.leg))
        args.append(str(rec.seq))
        args.append("1" if rec.type in INDEXED_TYPES else "0")
        args.append(json.dumps([x for item in rec.fields.items() for x in item], ensure_ascii=False))
    return keys, args


def parse_outcome(reply: Sequence[str | bytes], n_records: int) -> BatchOutcome:
    stored: list[bool] = []
    for item in reply:
        text = item.decode("utf-8", "replace") if isinstance(item, bytes) else str(item)
        if text.startswith("!"):
            return BatchOutcome(tuple(stored), text[1:] or "unknown error")
        stored.append(text != "")
    if len(stored) != n_records:
        return BatchOutcome(tuple(stored), f"script answered {len(stored)} of {n_records} records")
    return BatchOutcome(tuple(stored))
