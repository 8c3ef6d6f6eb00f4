-- Read one unexpired claim (is_claimed, get_token).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = task id
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- returns: {instance, created_at, expires_at, owner}, or {} when absent or expired
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then
  return {}
end
local e = parse_entry(raw)
if now_ms(ARGV[2]) >= e.expires then
  return {}
end
return {e.instance, e.created, e.expires, owner_of(KEYS[2], e)}
