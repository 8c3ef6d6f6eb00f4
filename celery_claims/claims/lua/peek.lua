-- Read one unexpired claim (is_claimed, get_token).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- ARGV[1] = task id
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- returns: {instance, created_at, expires_at, owner}, or {} when absent or expired
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then
  return {}
end
local instance, created, expires, owner = parse_entry(entry)
if now_ms(ARGV[2]) >= expires then
  return {}
end
return {tonumber(instance), created, expires, owner}
