-- Read what the store holds for some tasks, expired or not (operators' views, tests).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = completion records of the queue ({q}:d)
-- KEYS[3] = owners hash of the queue        ({q}:o)
-- ARGV[1 ...] = task ids
-- returns: 11 values per task: its claim's instance (0: no claim), created_at, expires_at,
--          takeovers, owner, 1 if it is a takeover's claim whose start is not marked (else
--          0); its record's kind (0: no record, 7 done, 8 given up), instance or takeovers,
--          done_at or given_up_at, until, owner
local out = {}
for _, task in ipairs(ARGV) do
  local raw = redis.call('HGET', KEYS[1], task)
  if raw then
    local e = parse_entry(raw)
    local unstarted = 0
    if e.unstarted then
      unstarted = 1
    end
    for _, v in ipairs({e.instance, e.created, e.expires, e.takeovers, owner_of(KEYS[3], e),
                        unstarted}) do
      out[#out + 1] = v
    end
  else
    for _, v in ipairs({0, 0, 0, 0, '', 0}) do
      out[#out + 1] = v
    end
  end
  raw = redis.call('HGET', KEYS[2], task)
  if raw then
    local r = parse_record(raw)
    for _, v in ipairs({r.kind, r.number, r.at, r.until_ms, owner_of(KEYS[3], r)}) do
      out[#out + 1] = v
    end
  else
    for _, v in ipairs({0, 0, 0, 0, ''}) do
      out[#out + 1] = v
    end
  end
end
return out
