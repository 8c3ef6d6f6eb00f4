-- Extend a claim (the Rust AtomicClaimManager's extend): the extension is added to the old expiry.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = task id
-- ARGV[2] = owner of the token
-- ARGV[3] = instance of the token
-- ARGV[4] = additional ms
-- returns: {1, instance, created_at, expires_at, owner} | {4} | {5} | {6}
local status, e = check_token(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3])
if status ~= 1 then
  return {status}
end
e.expires = e.expires + tonumber(ARGV[4])
own(KEYS[2], e)
redis.call('HSET', KEYS[1], ARGV[1], format_entry(e.instance, e.created, e.expires,
  e.takeovers, e.unstarted, e.oid, e.tail))
return {1, e.instance, e.created, e.expires, ARGV[2]}
