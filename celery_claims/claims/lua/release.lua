-- Release a claim (the original's release); with a TTL, also keep a completion record.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- KEYS[3] = stats hash of the queue         ({q}:s)
-- KEYS[4] = completion records of the queue ({q}:d)  task -> instance:done_at:until:owner
-- KEYS[5] = retention sorted set of records ({q}:x)  task -> until
-- KEYS[6] = takeover counts of the queue    ({q}:t)  task -> takeovers so far
-- ARGV[1] = task id
-- ARGV[2] = owner of the token
-- ARGV[3] = instance of the token
-- ARGV[4] = completion record TTL in ms, or '' for a plain release
-- ARGV[5] = now in epoch ms, or '' for the server clock
-- returns: {1 released} | {4 NOT_FOUND} | {5 STALE} | {6 NOT_OWNER}
local status, instance = check_token(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if status ~= 1 then
  return {status}
end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
-- the task ended under a live owner: it is no poison, and its count must not outlive it
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'acks', 1)
if ARGV[4] ~= '' then
  local ttl = tonumber(ARGV[4])
  if ttl > 0 then
    local now = now_ms(ARGV[5])
    -- records expire like claims (judged by the same clock, purged by cleanup), not by a
    -- key TTL, which runs on the server's real time even when the caller sends its own clock
    -- a completion record has the shape of an entry: instance:done_at:until:owner
    redis.call('HSET', KEYS[4], ARGV[1], format_entry(instance, now, now + ttl, ARGV[2]))
    redis.call('ZADD', KEYS[5], fmt(now + ttl), ARGV[1])
  end
end
return {1}
