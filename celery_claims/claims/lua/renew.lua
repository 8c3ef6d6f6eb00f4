-- Renew many claims of one queue in one round trip: expires_at = max(expires_at, now + lease).
-- KEYS[1] = claims hash of the queue        ({q}:c)
-- KEYS[2] = owners hash of the queue        ({q}:o)
-- ARGV[1] = lease in ms
-- ARGV[2] = now in epoch ms, or '' for the server clock
-- ARGV[3 + 3i], ARGV[4 + 3i], ARGV[5 + 3i] = task id, owner, instance of token i
-- returns: {status_1, created_at_1, expires_at_1, status_2, ...} as stored after the renewal
--          status 1 renewed | 4 NOT_FOUND | 5 STALE | 6 NOT_OWNER (times 0 when refused)
local now = now_ms(ARGV[2])
local target = now + tonumber(ARGV[1])
local out = {}
for i = 3, #ARGV, 3 do
  local task = ARGV[i]
  local status, e = check_token(KEYS[1], KEYS[2], task, ARGV[i + 1], ARGV[i + 2])
  local created_at, expires_at = 0, 0
  if status == 1 then
    created_at = e.created
    expires_at = math.max(e.expires, target)
    if expires_at ~= e.expires then
      e.expires = expires_at
      own(KEYS[2], e)
      redis.call('HSET', KEYS[1], task, format_entry(e.instance, e.created,
        e.expires, e.takeovers, e.unstarted, e.oid, e.tail))
    end
  end
  out[#out + 1] = status
  out[#out + 1] = created_at
  out[#out + 1] = expires_at
end
return out
