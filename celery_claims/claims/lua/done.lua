-- Read a task's live completion record.
-- KEYS[1] = completion records of the queue ({q}:d)
-- ARGV[1] = task id
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- returns: {instance, done_at, owner}, or {} when absent or past its retention
local record = redis.call('HGET', KEYS[1], ARGV[1])
if not record then
  return {}
end
local instance, done_at, until_ms, owner = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
if now_ms(ARGV[2]) >= tonumber(until_ms) then
  return {}
end
return {tonumber(instance), tonumber(done_at), owner}
