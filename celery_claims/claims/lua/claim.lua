-- Claim a task: the original's claim, optionally refusing a task with a completion record.
-- KEYS[1] = claims hash of the queue        ({q}:c)  task -> entry
-- KEYS[2] = expiry sorted set of the queue  ({q}:e)  task -> expires_at
-- KEYS[3] = instance counter of the queue   ({q}:n)
-- KEYS[4] = stats hash of the queue         ({q}:s)
-- KEYS[5] = completion records of the queue ({q}:d)  task -> instance:done_at:until:owner
-- ARGV[1] = task id
-- ARGV[2] = owner
-- ARGV[3] = lease in ms
-- ARGV[4] = now in epoch ms, or '' for the server clock
-- ARGV[5] = '1': answer DONE when a live completion record exists; '0': ignore records
-- returns: {1 SUCCESS | 3 TOOK_OVER, instance, created_at, expires_at, previous owner or ''}
--          {2 ALREADY_CLAIMED, holder, expires_at}
--          {7 DONE, instance, done_at, owner}
local now = now_ms(ARGV[4])
-- attempts are counted first, whatever the outcome (the original's order)
redis.call('HINCRBY', KEYS[4], 'attempts', 1)

if ARGV[5] == '1' then
  local record = redis.call('HGET', KEYS[5], ARGV[1])
  if record then
    local instance, done_at, until_ms, owner = string.match(record, '^(%d+):(%d+):(%d+):(.*)$')
    if now < tonumber(until_ms) then
      return {7, tonumber(instance), tonumber(done_at), owner}
    end
  end
end

local previous = ''
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if entry then
  local _, _, expires, owner = parse_entry(entry)
  -- the same owner re-claims whether expired or not; only another owner is judged by expiry
  if owner ~= ARGV[2] then
    if now < expires then
      redis.call('HINCRBY', KEYS[4], 'contentions', 1)
      return {2, owner, expires}
    end
    previous = owner
  end
end

local instance = redis.call('INCR', KEYS[3])
local expires = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], format_entry(fmt(instance), now, expires, ARGV[2]))
redis.call('ZADD', KEYS[2], fmt(expires), ARGV[1])
if previous ~= '' then
  redis.call('HINCRBY', KEYS[4], 'takeovers', 1)
  return {3, instance, now, expires, previous}
end
redis.call('HINCRBY', KEYS[4], 'successes', 1)
return {1, instance, now, expires, ''}
