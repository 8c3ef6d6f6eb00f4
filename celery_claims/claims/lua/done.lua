-- Read a task's live completion record.
-- KEYS[1] = completion record of the task   ({q}:d:<task>)
-- ARGV[1] = now in epoch ms, or '' for the server clock
-- returns: {instance, done_at, owner}, or {} when absent or past its retention
local record = redis.call('GET', KEYS[1])
if not record then
  return {}
end
local instance, done_at, until_ms, owner = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
if now_ms(ARGV[1]) >= tonumber(until_ms) then
  return {}
end
return {tonumber(instance), tonumber(done_at), owner}
