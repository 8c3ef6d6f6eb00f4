-- Record a completion and acknowledge the message's delivery on kombu's Redis broker, in one
-- step: the delivery is removed only if the completion is recorded for this very token.
-- Used when the claim store is the broker's own Redis (same server and database); without
-- KEYS[5..6], only the record (a record this token wrote before counts as written: a pool
-- process may have sent it ahead).
-- KEYS[1..4] = as release.lua
-- KEYS[5] = kombu's unacked index (sorted set: delivery tag -> delivered at), or absent
-- KEYS[6] = kombu's unacked hash (delivery tag -> message), or absent
-- ARGV[1..5] = as release.lua (ARGV[4], the record TTL, must not be '')
-- ARGV[6] = the delivery tag ('' without KEYS[5..6])
-- returns: {1 recorded, acked} | {7 recorded before by this token, acked}
--        | {4 NOT_FOUND} | {5 STALE} | {6 NOT_OWNER}: nothing written, the delivery left alone
-- (on the Redis broker a restored message keeps its tag: another copy's delivery may be this
-- very record, so a refused token must never remove it)
local status = release_claim(KEYS, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if status ~= 1 then
  local raw = redis.call('HGET', KEYS[3], record_field(ARGV[1], ARGV[2]))
  if not raw then
    return {status}
  end
  local r = parse_record(raw)
  if r.kind ~= 7 or r.number ~= tonumber(ARGV[3]) or owner_of(KEYS[4], r) ~= ARGV[2] then
    return {status}
  end
  status = 7
end
if #KEYS == 6 then
  redis.call('ZREM', KEYS[5], ARGV[6])
  redis.call('HDEL', KEYS[6], ARGV[6])
end
return {status}
