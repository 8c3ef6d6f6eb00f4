-- Is a task held by another owner's live lease, with its message journaled? Both read in one
-- step: a copy of a task acknowledged at claim may be acked unrun only when both hold at once.
-- KEYS[1] = claims hash of the queue              ({q}:c)
-- KEYS[2] = owners hash of the queue              ({q}:o)
-- KEYS[3] = journaled messages of the queue       ({q}:j)
-- ARGV[1] = task id (the attempt's claim id)
-- ARGV[2] = the asking copy's owner (its own claim holds nothing against it)
-- ARGV[3] = now in epoch ms, or '' for the server clock
-- returns: {0 NOT_HELD} (no claim, an expired one, or the asker's own)
--          {1 JOURNALED, holder, expires_at} | {2 NOT_JOURNALED, holder, expires_at}
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  return {0}
end
local e = parse_entry(raw)
if now_ms(ARGV[3]) >= e.expires then
  return {0}
end
local holder = owner_of(KEYS[2], e)
if holder == ARGV[2] then
  return {0}
end
if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return {1, holder, e.expires}
end
return {2, holder, e.expires}
