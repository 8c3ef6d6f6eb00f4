-- Extend a claim (the original's extend): the extension is added to the old expiry.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- ARGV[1] = task id
-- ARGV[2] = owner of the token
-- ARGV[3] = instance of the token
-- ARGV[4] = additional ms
-- returns: {1, instance, created_at, expires_at, owner} | {4} | {5} | {6}
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return {4}
end
local instance, created, expires, owner = parse_entry(entry)
if instance ~= ARGV[3] then
  return {5}
end
if owner ~= ARGV[2] then
  return {6}
end
expires = expires + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], ARGV[1],
  instance .. ':' .. fmt(created) .. ':' .. fmt(expires) .. ':' .. owner)
redis.call('ZADD', KEYS[2], fmt(expires), ARGV[1])
return {1, tonumber(instance), created, expires, owner}
