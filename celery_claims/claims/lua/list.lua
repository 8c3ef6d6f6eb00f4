-- List or count the unexpired claims of a queue.
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- ARGV[2] = 'count' for the number only, 'list' for the entries
-- returns: count, or {task_1, entry_1, task_2, entry_2, ...} soonest expiry first
local lower = '(' .. fmt(now_ms(ARGV[1]))
if ARGV[2] == 'count' then
  return redis.call('ZCOUNT', KEYS[2], lower, '+inf')
end
local tasks = redis.call('ZRANGEBYSCORE', KEYS[2], lower, '+inf')
local out = {}
-- one HGET per task rather than HMGET(unpack(...)): unpack is bounded by Lua's C stack
for _, task in ipairs(tasks) do
  out[#out + 1] = task
  out[#out + 1] = redis.call('HGET', KEYS[1], task)
end
return out
