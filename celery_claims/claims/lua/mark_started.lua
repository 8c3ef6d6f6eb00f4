-- Mark that the holder of a claim started the task's body (counted by claim.lua's takeover
-- limit only then, for a claim granted by a takeover).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = task id
-- ARGV[2] = owner of the token
-- ARGV[3] = instance of the token
-- returns: {1 marked (or nothing to mark)} | {4 NOT_FOUND} | {5 STALE} | {6 NOT_OWNER}
local status, e = check_token(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
if status == 1 and e.unstarted then
  e.unstarted = false
  own(KEYS[2], e)
  redis.call('HSET', KEYS[1], ARGV[1], format_entry(e.instance, e.created,
    e.expires, e.takeovers, e.unstarted, e.oid, e.tail))
end
return {status}
