-- Read a task's live completion record (done or given up).
-- KEYS[1] = completion records of the queue ({q}:d)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = task id
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- returns: {7 DONE, instance, done_at, owner} | {8 GIVEN_UP, takeovers, given_up_at, owner},
--          or {} when absent or past its retention
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  return {}
end
local r = parse_record(raw)
if now_ms(ARGV[2]) >= r.until_ms then
  return {}
end
return {r.kind, r.number, r.at, owner_of(KEYS[2], r)}
