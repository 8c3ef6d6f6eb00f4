-- Extend a claim (the original's extend): the extension is added to the old expiry.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- ARGV[1] = task id
-- ARGV[2] = owner of the token
-- ARGV[3] = instance of the token
-- ARGV[4] = additional ms
-- returns: {1, instance, created_at, expires_at, owner} | {4} | {5} | {6}
local status, instance, created, expires = check_token(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if status ~= 1 then
  return {status}
end
expires = expires + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1], format_entry(instance, created, expires, ARGV[2]))
redis.call('ZADD', KEYS[2], fmt(expires), ARGV[1])
return {1, tonumber(instance), created, expires, ARGV[2]}
