-- Take the journaled messages whose recover time has passed, pushing each one's forward.
-- (Self-contained: not prefixed with _common.lua.)
-- KEYS[1] = journaled messages of the queue       ({q}:j)
-- KEYS[2] = their recover times, ms               ({q}:jt)
-- KEYS[3] = their re-publish counts               ({q}:jn)
-- ARGV[1] = most entries to take
-- ARGV[2] = ms to push each taken entry's recover time forward
-- returns: {now, task id, message, re-publish count, task id, message, count, ...}
-- Taking and pushing forward in one step means two workers scanning at once (the scan lock
-- expired mid-scan, say) never take the same entry twice.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now),
                       'LIMIT', 0, tonumber(ARGV[1]))
local next_at = string.format('%.0f', now + tonumber(ARGV[2]))
local out = {now}
for _, task in ipairs(due) do
  local message = redis.call('HGET', KEYS[1], task)
  if message then
    redis.call('ZADD', KEYS[2], next_at, task)
    out[#out + 1] = task
    out[#out + 1] = message
    out[#out + 1] = tonumber(redis.call('HGET', KEYS[3], task) or '0')
  else
    -- a time without its message (cleared between two writes): nothing to recover
    redis.call('ZREM', KEYS[2], task)
    redis.call('HDEL', KEYS[3], task)
  end
end
return out
